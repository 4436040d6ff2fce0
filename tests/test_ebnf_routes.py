"""Every constraint kind through every route that takes it, on a random-weight tiny model sampled at
temperature 1: the grammar alone must shape the output. EBNF (GBNF) grammars are checked with an
independent oracle, a regex of the same language under `re.fullmatch`; a malformed one is a 400
naming the `ebnf` field, and a fault inside the grammar backend is a logged 500, never a 400."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import jsonschema
import pytest

from server_utils import running_server

SAMPLES = 100

YES_NO = ('root ::= "yes" | "no"', r"yes|no")
# Rule references, grouping, alternation, char classes, bounded repetition, a comment.
ARITH_GBNF = r"""
# a sum of at most four terms, each a number or a parenthesised run of up to three numbers
root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" num (op num){0,2} ")"
num ::= "0" | [1-9] [0-9]{0,2}
op ::= "+" | "-" | "*"
"""
_NUM, _OP = r"(0|[1-9][0-9]{0,2})", r"[-+*]"
_TERM = rf"({_NUM}|\({_NUM}({_OP}{_NUM}){{0,2}}\))"
ARITH = (ARITH_GBNF, rf"{_TERM}({_OP}{_TERM}){{0,3}}")
LIST_GBNF = r"""
root ::= "[" item ("," item){0,4} "]"
item ::= word | int-lit
word ::= "\"" [a-z]{1,5} "\""
int-lit ::= "-"? [0-9]{1,3}
"""
LIST = (LIST_GBNF, r'\[("[a-z]{1,5}"|-?[0-9]{1,3})(,("[a-z]{1,5}"|-?[0-9]{1,3})){0,4}\]')
GRAMMARS = {"yes_no": YES_NO, "arith": ARITH, "list": LIST}
RARE_BRANCH = {"arith": "(", "list": '"'}

IPV4_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4 = rf"({IPV4_OCTET}\.){{3}}{IPV4_OCTET}"
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 20}},
          "required": ["kind", "age"], "additionalProperties": False}
# The trigger is one common letter, so a random model opens tags often: every "a" it writes must
# start `a={"zone": ...};` (the last one may be cut short by max_new_tokens).
ZONE_TAG = {"structures": [{"begin": "a=", "schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}, "end": ";"}], "triggers": ["a"]}
TAG_BODIES = ('={"zone":"UTC"};', '={"zone":"CET"};')
BAD_EBNF = 'root ::= "a" | ('


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--max-running-requests", "64") as handle:
        yield handle


def _generate(server, constraint, max_new=96):
    params = {"temperature": 1.0, "max_new_tokens": max_new, **constraint}
    prompts = [f"Sample {i}: the answer is" for i in range(SAMPLES)]
    resp = server.post("/generate", json={"text": prompts, "sampling_params": params}, timeout=900)
    assert resp.status_code == 200, resp.text
    outs = resp.json()
    assert len(outs) == SAMPLES
    return [(o["text"], o["meta_info"]["finish_reason"]["type"]) for o in outs]


def _completions(server, extra, max_new=96):
    body = {"model": "m", "prompt": [f"Item {i}:" for i in range(SAMPLES)], "max_tokens": max_new,
            "temperature": 1.0, **extra}
    resp = server.post("/v1/completions", json=body, timeout=900)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == SAMPLES
    return [(c["text"], c["finish_reason"]) for c in choices]


def _chat(server, extra, max_new=96):
    body = {"model": "m", "messages": [{"role": "user", "content": "Answer in the format."}], "n": SAMPLES,
            "max_tokens": max_new, "temperature": 1.0, **extra}
    resp = server.post("/v1/chat/completions", json=body, timeout=900)
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert len(choices) == SAMPLES
    return [(c["message"]["content"], c["finish_reason"]) for c in choices]


ROUTES = {
    "generate": lambda server, field, value: _generate(server, {field: value}),
    "completions": lambda server, field, value: _completions(server, {field: value}),
    "chat": lambda server, field, value: _chat(server, {field: value}),
}


def _assert_all_in_language(outs, pattern):
    bad = [text for text, _ in outs if not re.fullmatch(pattern, text)]
    assert not bad, f"{len(bad)} of {len(outs)} outputs outside the language: {bad[:3]}"
    assert all(reason == "stop" for _, reason in outs), sorted({reason for _, reason in outs})


# ---------------------------------------------------------------------- ebnf
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("grammar", sorted(GRAMMARS))
def test_ebnf_outputs_are_all_in_the_grammars_language(server, route, grammar):
    gbnf, pattern = GRAMMARS[grammar]
    outs = ROUTES[route](server, "ebnf", gbnf)
    _assert_all_in_language(outs, pattern)
    texts = {text for text, _ in outs}
    if grammar == "yes_no":
        assert texts == {"yes", "no"}
    else:  # varied, and the rarer branch (a group, a quoted word; ~10% each here) is taken too
        assert len(texts) > 20 and any(RARE_BRANCH[grammar] in text for text in texts), sorted(texts)[:10]


def test_the_oracles_reject_what_the_grammars_reject():
    """The regexes are not vacuous: near misses of each language fail them."""
    for text in ("yes!", "No", ""):
        assert not re.fullmatch(YES_NO[1], text)
    for text in ("1+", "(1+2", "01", "1+2+3+4+5", "(1+2+3+4)", "1/2"):
        assert not re.fullmatch(ARITH[1], text), text
    for text in ("[]", '["abcdef"]', "[1,2,3,4,5,6]", "[1234]", '["A"]'):
        assert not re.fullmatch(LIST[1], text), text
    assert re.fullmatch(ARITH[1], "(12*0-3)+7") and re.fullmatch(LIST[1], '["ab",-12,7]')


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_malformed_ebnf_is_400_naming_the_ebnf_field(server, route):
    path = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}[route]
    if route == "generate":
        body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "ebnf": BAD_EBNF}}
    elif route == "completions":
        body = {"model": "m", "prompt": "Hi", "max_tokens": 4, "ebnf": BAD_EBNF}
    else:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ebnf": BAD_EBNF}
    resp = server.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == ("sampling_params.ebnf" if route == "generate" else "ebnf")  # as the route spells it
    assert "ebnf does not compile" in error["message"] and "Expected ')'" in error["message"]
    for grammar, needle in (("root ::= item", "Rule 'item' not found"), ('item ::= "x"', "No 'root' rule")):
        resp = server.post("/generate", json={"text": "Hi", "sampling_params": {"ebnf": grammar}})
        assert resp.status_code == 400 and needle in resp.json()["error"]["message"], resp.text
    assert server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200


# ---------------------------------------------------------------------- the other kinds
@pytest.mark.parametrize("route,field", [("generate", "regex"), ("completions", "regex"), ("chat", "regex")])
def test_regex_outputs_fullmatch_on_every_route(server, route, field):
    _assert_all_in_language(ROUTES[route](server, field, IPV4), IPV4)


@pytest.mark.parametrize("route", ["generate", "completions", "chat"])
def test_json_schema_outputs_validate_on_every_route(server, route):
    if route == "generate":
        outs = _generate(server, {"json_schema": json.dumps(SCHEMA)})
    elif route == "completions":
        outs = _completions(server, {"json_schema": json.dumps(SCHEMA)})
    else:
        outs = _chat(server, {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}})
    for text, reason in outs:
        jsonschema.validate(json.loads(text), SCHEMA)
        assert reason == "stop"


@pytest.mark.parametrize("route", ["generate", "completions", "chat"])
def test_structural_tag_segments_follow_their_schema_on_every_route(server, route):
    if route == "generate":
        outs = _generate(server, {"structural_tag": json.dumps(ZONE_TAG)})
    else:
        run = _completions if route == "completions" else _chat
        outs = run(server, {"response_format": {"type": "structural_tag", **ZONE_TAG}})
    tagged = 0
    for text, reason in outs:
        segments = text.split("a")[1:]  # what follows each "a"
        for i, segment in enumerate(segments):
            if not segment.startswith(TAG_BODIES):  # only the last tag may be cut, by max_new_tokens
                assert i == len(segments) - 1 and reason == "length", (text, reason)
                assert any(body.startswith(segment) for body in TAG_BODIES), text
        tagged += len(segments)
    assert tagged > 10, "the oracle must see tags: the random model writes 'a' often"


# ---------------------------------------------------------------------- server faults are not 400s
def test_a_converter_fault_is_not_reported_as_a_grammar_error(monkeypatch):
    import llguidance.gbnf_to_lark as converter

    from srt.constrained.base_grammar_backend import GrammarError
    from srt.constrained.llguidance_backend import ebnf_to_lark

    with pytest.raises(GrammarError) as err:
        ebnf_to_lark("root ::= missing")
    assert err.value.field == "ebnf"
    with pytest.raises(GrammarError, match="too deeply"):
        ebnf_to_lark("root ::= " + "(" * 5000 + '"a"' + ")" * 5000)

    def broken(text):
        raise TypeError("'module' object is not callable")

    monkeypatch.setattr(converter, "gbnf_to_lark", broken)
    with pytest.raises(TypeError):
        ebnf_to_lark(YES_NO[0])


def test_a_backend_fault_is_a_logged_500_and_a_grammar_error_a_400(caplog):
    from managers.generate_input import RequestError
    from managers.tokenizer_manager import TokenizerManager
    from srt.constrained.base_grammar_backend import BaseGrammarBackend, GrammarError

    class Backend(BaseGrammarBackend):
        def _compile(self, key):
            if key[1] == "bad":
                raise GrammarError("ebnf", "Expected name")
            raise TypeError("'module' object is not callable")

    manager = SimpleNamespace(_grammar_backend=Backend(), server_args=None, tokenizer=None, vocab_size=0)
    params = SimpleNamespace(regex=None, json_schema=None, ebnf="bad", structural_tag=None)
    with pytest.raises(RequestError) as err:
        asyncio.run(TokenizerManager._check_grammar(manager, params))
    assert (err.value.status_code, err.value.param) == (400, "sampling_params.ebnf")
    params.ebnf = YES_NO[0]
    with caplog.at_level("ERROR"), pytest.raises(RequestError) as err:
        asyncio.run(TokenizerManager._check_grammar(manager, params))
    assert err.value.status_code == 500 and err.value.code == "internal_error"
    assert "TypeError" in err.value.message
    assert any(r.exc_info and r.exc_info[0] is TypeError for r in caplog.records)
    manager._grammar_backend.shutdown()
