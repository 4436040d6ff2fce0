"""Grammar-constrained decoding on a random-weight tiny model: the grammar, not the model,
guarantees the output. Sampled at temperature 1.0, every output must match (`re.fullmatch`,
`jsonschema`), also with n = 4, forced retraction, chunked prefill and page size 16."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from server_utils import running_server

IPV4 = r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
INTEGER = r"-?(0|[1-9][0-9]{0,8})"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id", "vip"], "additionalProperties": False},
    },
    "required": ["name", "kind", "owner"],
    "additionalProperties": False,
}
SAMPLES = 100


@pytest.fixture(scope="module", params=["plain", "page16-chunked-retract"])
def server(request, llama_model):
    args = ["--max-total-tokens", "65536", "--max-running-requests", "64"]
    env = None
    if request.param != "plain":
        args += ["--page-size", "16", "--chunked-prefill-size", "16"]
        env = {"SRT_TEST_RETRACT_INTERVAL": "4"}
    with running_server(llama_model, *args, env=env) as handle:
        yield handle


def _generate(server, constraint, n_prompts=SAMPLES, n=1, max_new=96):
    params = {"temperature": 1.0, "max_new_tokens": max_new, "n": n, **constraint}
    prompts = [f"Sample {i}: the answer is" for i in range(n_prompts)]
    resp = server.post("/generate", json={"text": prompts, "sampling_params": params}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("pattern", [IPV4, INTEGER], ids=["ipv4", "integer"])
def test_regex_outputs_all_fullmatch(server, pattern):
    outs = _generate(server, {"regex": pattern})
    assert len(outs) == SAMPLES
    bad = [o["text"] for o in outs if not re.fullmatch(pattern, o["text"])]
    assert not bad, f"{len(bad)} outputs do not match: {bad[:3]}"
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    assert len({o["text"] for o in outs}) > 10, "temperature 1.0 should give varied outputs"


def test_json_schema_outputs_all_validate(server):
    outs = _generate(server, {"json_schema": json.dumps(SCHEMA)}, max_new=160)
    for o in outs:
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
    assert len({o["text"] for o in outs}) > 10


def test_n4_children_each_follow_the_grammar(server):
    outs = _generate(server, {"regex": IPV4}, n_prompts=5, n=4)
    assert len(outs) == 20
    assert all(re.fullmatch(IPV4, o["text"]) for o in outs), [o["text"] for o in outs]


@pytest.mark.parametrize("field,value,needle", [
    ("regex", "(unclosed", "unclosed group"),
    ("json_schema", "{not json", "not valid JSON"),
    ("ebnf", "root ::= (", ""),
])
def test_a_grammar_that_does_not_compile_is_400_naming_the_field(server, field, value, needle):
    resp = server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, field: value}})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == f"sampling_params.{field}"
    assert error["message"].startswith(f"sampling_params.{field} does not compile: ") and needle in error["message"]
    ok = server.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200


def test_the_stress_configuration_really_retracted(server, request):
    counters = server.get("/get_server_info").json()["load"]["counters"]
    if "retract" in request.node.callspec.id:
        assert counters["num_retractions"] > 0
    else:
        assert counters["num_retractions"] == 0


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_openai_completions_regex_and_chat_response_format(server):
    client = _client(server)
    comp = client.completions.create(model="m", prompt=[f"Address {i}:" for i in range(SAMPLES)], max_tokens=32,
                                     temperature=1.0, extra_body={"regex": IPV4})
    assert len(comp.choices) == SAMPLES and all(re.fullmatch(IPV4, c.text) for c in comp.choices)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Describe a pet as JSON."}], max_tokens=160,
        temperature=1.0, n=SAMPLES,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}})
    assert len(chat.choices) == SAMPLES
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    anything = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "JSON please."}], max_tokens=64, temperature=1.0, n=8,
        response_format={"type": "json_object"})
    for choice in anything.choices:
        if choice.finish_reason == "stop":  # a free-form object may outgrow max_tokens
            assert isinstance(json.loads(choice.message.content), dict)


def test_openai_bad_response_format_is_400_naming_it(server):
    import openai

    client = _client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=4,
                                  extra_body={"regex": "a", "response_format": {"type": "json_object"}})
    assert "mutually exclusive" in err.value.body["message"]


TAG = {"structures": [{"begin": "<function=get_time>", "schema": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}, "end": "</function>"}], "triggers": ["<function="]}


def test_structural_tag_constrains_each_triggered_segment(llama_model):
    """Free text until the trigger, then `begin`, JSON of the schema, `end` (checked on the matcher
    directly: a random model rarely writes the trigger by itself)."""
    import torch

    from srt.constrained.base_grammar_backend import create_grammar_backend
    from srt.utils.hf_transformers_utils import get_tokenizer

    tokenizer = get_tokenizer(str(llama_model))
    vocab = json.loads((llama_model / "config.json").read_text())["vocab_size"]
    backend = create_grammar_backend("llguidance", tokenizer, vocab)
    template = backend.compile_now(("structural_tag", json.dumps(TAG)))
    gen = torch.Generator().manual_seed(0)
    for trial in range(10):
        grammar = template.copy()
        out = tokenizer.encode("It is time: <function=get_time>", add_special_tokens=False)
        for tok in out:
            assert grammar.accept_token(tok)
        mask = torch.zeros(vocab, dtype=torch.bool)
        for _ in range(80):
            grammar.fill_vocab_mask(mask)
            allowed = (~mask).nonzero().flatten()
            tok = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            assert grammar.accept_token(tok)
            out.append(tok)
            if "</function>" in tokenizer.decode(out):
                break
        text = tokenizer.decode(out)
        body = text.split("<function=get_time>", 1)[1].split("</function>", 1)[0]
        jsonschema.validate(json.loads(body), TAG["structures"][0]["schema"])


def test_structural_tag_is_accepted_by_both_apis_and_checked(server):
    ok = server.post("/generate", json={"text": "Hi", "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "structural_tag": json.dumps(TAG)}})
    assert ok.status_code == 200, ok.text
    chat = server.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                      "max_tokens": 8, "response_format": {"type": "structural_tag",
                                                                                           **TAG}})
    assert chat.status_code == 200, chat.text
    bad = server.post("/generate", json={"text": "Hi", "sampling_params": {"structural_tag": json.dumps(
        {"structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}], "triggers": ["<y"]})}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.structural_tag"
    assert "starts with no trigger" in bad.json()["error"]["message"]
