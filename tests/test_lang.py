"""The frontend language (`srt/lang`) against a real server and against an in-process Engine.

Every test runs on both backends over the committed demo model (a real tokenizer and its ChatML
template), greedy unless it says otherwise; expected values come from plain `/generate` requests
(or the Engine's `generate`), the tokenizer's own chat template and `re.fullmatch`, never from
the language itself.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest

import srt.lang as sgl
from server_utils import running_server

DEMO = Path(__file__).resolve().parent.parent / "srt" / "demo_model"
GREEDY = {"temperature": 0}
CHOICES = [" Paris", " London", " Berlin", " the"]


class Raw:
    """Plain native requests, the oracle for what the language computed."""

    def __init__(self, backend):
        self.backend = backend

    def generate(self, body):
        return self.backend._generate(body)

    def load(self):
        return self.backend.get_server_info()["load"] if isinstance(self.backend, sgl.RuntimeEndpoint) \
            else vars(self.backend.engine.get_load())


@pytest.fixture(scope="module", params=["server", "engine"])
def backend(request):
    if request.param == "server":
        with running_server(DEMO, "--max-total-tokens", "16384") as handle:
            yield sgl.RuntimeEndpoint(handle.url)
    else:
        engine = sgl.Engine(model_path=str(DEMO), device="cpu", dtype="float32", max_total_tokens=16384)
        try:
            yield sgl.EngineBackend(engine)
        finally:
            engine.shutdown()


def wait_idle(raw: Raw, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        load = raw.load()
        if load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0:
            return load
        assert time.monotonic() < deadline, f"not idle: {load}"
        time.sleep(0.1)


@sgl.function
def stop_prog(s, topic):
    s += f"Write about {topic}.\n" + sgl.gen("out", max_tokens=24, stop=[" ", "\n"], temperature=0)
    s += "|" + sgl.gen("free", max_tokens=6, temperature=0)


def test_gen_with_stop_is_trimmed_and_equals_generate(backend):
    state = stop_prog.run(topic="the sea", backend=backend)
    out = state["out"]
    assert " " not in out and "\n" not in out
    raw = Raw(backend).generate({"text": "Write about the sea.\n",
                                 "sampling_params": {"max_new_tokens": 24, "stop": [" ", "\n"], **GREEDY}})
    assert out == raw["text"]
    assert state.get_meta_info("out")["finish_reason"]["type"] == "stop"
    assert state.text() == "Write about the sea.\n" + out + "|" + state["free"]
    assert state["free"] != ""


@sgl.function
def select_prog(s, method):
    s += "The capital of France is"
    s += sgl.select("city", choices=CHOICES, choices_method=method)


def hand_scores(raw: Raw, prefix: str, choices):
    """SGLang's definition: mean logprob of the tokens from the prefix's last one to the end."""
    p = raw.generate({"text": prefix, "sampling_params": {"max_new_tokens": 0}})["meta_info"]["prompt_tokens"]
    scores = []
    for choice in choices:
        full = raw.generate({"text": prefix + choice, "sampling_params": {"max_new_tokens": 0},
                             "return_logprob": True, "logprob_start_len": 0})
        values = [e[0] for e in full["meta_info"]["input_token_logprobs"][p - 1:]]
        scores.append(sum(values) / len(values))
    return scores


def test_select_scores_equal_a_hand_computation(backend):
    state = select_prog.run(method=sgl.token_length_normalized, backend=backend)
    meta = state.get_meta_info("city")
    expected = hand_scores(Raw(backend), "The capital of France is", CHOICES)
    assert meta["normalized_prompt_logprobs"] == pytest.approx(expected, abs=1e-5)
    best = max(range(len(CHOICES)), key=lambda i: expected[i])
    assert state["city"] == CHOICES[best]
    assert state.text() == "The capital of France is" + CHOICES[best]


def test_select_other_methods_pick_a_choice(backend):
    greedy = select_prog.run(method=sgl.greedy_token_selection, backend=backend)
    assert greedy["city"] in CHOICES
    matrix = greedy.get_meta_info("city")["greedy_logprob_matrix"]
    first = [row[0] for row in matrix]
    assert CHOICES.index(greedy["city"]) in [i for i, v in enumerate(first) if v == max(first)]
    uncond = select_prog.run(method=sgl.unconditional_likelihood_normalized, backend=backend)
    meta = uncond.get_meta_info("city")
    scores = meta["normalized_unconditional_prompt_logprobs"]
    assert uncond["city"] == CHOICES[scores.index(max(scores))]
    # each choice's tokens alone: one unconditional entry per scored entry
    assert [len(u) for u in meta["unconditional_token_logprobs"]] == [len(x) for x in meta["input_token_logprobs"]]


PREAMBLE = "A long shared preamble that every branch starts from, about rivers, mountains and seas. " * 3


@sgl.function
def fork_prog(s, n):
    s += PREAMBLE
    branches = s.fork(n)
    for i, branch in enumerate(branches):
        branch += f"Branch {i}:" + sgl.gen("part", max_tokens=6, temperature=0)
    branches.join()
    s += "Done."


def test_fork_children_hit_the_cache_and_join_gathers(backend):
    state = fork_prog.run(n=3, backend=backend)
    parts = state["part"]
    assert isinstance(parts, list) and len(parts) == 3
    metas = state.get_meta_info("part")
    for meta in metas:
        assert meta["cached_tokens"] > 0.8 * meta["prompt_tokens"] - 8, meta  # the shared preamble
    assert state.text().endswith("Done.")
    one = Raw(backend).generate({"text": PREAMBLE + "Branch 1:", "sampling_params": {"max_new_tokens": 6, **GREEDY}})
    assert parts[1] == one["text"]


@sgl.function
def stream_prog(s):
    s += "Once upon a time" + sgl.gen("story", max_tokens=24, temperature=0, ignore_eos=True)


def test_text_iter_streams_pieces_whose_running_sum_is_the_text(backend):
    state = stream_prog.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert len(pieces) > 3  # it really streamed
    final = state.text()
    running = ""
    for piece in pieces:
        running += piece
        assert final.startswith(running)  # each step's cumulative text is a prefix of the final one
    assert running == final
    var_state = stream_prog.run(backend=backend, stream=True)
    assert "".join(var_state.text_iter("story")) == var_state["story"] == state["story"]


@sgl.function
def batch_prog(s, i):
    s += "Shared instructions for every program in the batch: answer briefly and well. " * 2
    s += f"Question {i}: what is {i} plus {i}?" + sgl.gen("a", max_tokens=4, temperature=0)


def test_run_batch_of_32_with_two_threads(backend):
    states = batch_prog.run_batch([{"i": i} for i in range(32)], backend=backend, num_threads=2,
                                  progress_bar=True)
    assert len(states) == 32 and all(st.error() is None for st in states)
    raw = Raw(backend)
    for i in (0, 17, 31):
        prompt = states[i].text()[:-len(states[i]["a"]) or None]
        assert prompt.endswith(f"Question {i}: what is {i} plus {i}?")
        expected = raw.generate({"text": prompt, "sampling_params": {"max_new_tokens": 4, **GREEDY}})["text"]
        assert states[i]["a"] == expected
    assert all(st.get_meta_info("a")["cached_tokens"] > 0 for st in states)  # constant prefix pre-cached


@sgl.function
def chat_prog(s, question):
    s += sgl.system("You are terse.")
    with s.user():
        s += question
    with s.assistant():
        s += sgl.gen("answer", max_tokens=8, temperature=0)


def test_roles_render_through_the_chat_template(backend):
    from transformers import AutoTokenizer

    state = chat_prog.run(question="Name a colour.", backend=backend)
    answer = state["answer"]
    tok = AutoTokenizer.from_pretrained(str(DEMO))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": answer}]
    assert state.text() == tok.apply_chat_template(messages, tokenize=False)
    assert state.messages() == [{**m, "content": m["content"].lstrip()} for m in messages]
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    raw = Raw(backend).generate({"text": prompt, "sampling_params": {"max_new_tokens": 8, **GREEDY}})
    assert answer == raw["text"]


IPV4 = r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


@sgl.function
def constrained_prog(s):
    s += "Server address: " + sgl.gen("ip", regex=IPV4, max_tokens=24, temperature=1.0)
    s += "\nRecord: " + sgl.gen("rec", json_schema=SCHEMA, max_tokens=64, temperature=1.0)
    s += "\nCount: " + sgl.gen_int("count", max_tokens=6, temperature=1.0)


def test_constrained_gen_matches(backend):
    for state in constrained_prog.run_batch([{}] * 4, backend=backend):
        assert re.fullmatch(IPV4, state["ip"]), state["ip"]
        jsonschema.validate(json.loads(state["rec"]), SCHEMA)
        # dtype=int is SGLang's integer regex (trailing blanks allowed; a blank also stops it)
        assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", state["count"]), state["count"]
        assert isinstance(int(state["count"]), int)


@sgl.function
def failing_prog(s, i):
    s += "x" + sgl.gen("a", max_tokens=2, temperature=0)
    if i == 3:
        raise ValueError("program 3 fails on purpose")
    s += sgl.gen("b", max_tokens=2, temperature=0)


@sgl.function
def too_long_prog(s):
    s += "word " * 4000 + sgl.gen("a", max_tokens=4)


def test_errors_are_reported_per_program_and_carry_the_server_status(backend):
    states = failing_prog.run_batch([{"i": i} for i in range(6)], backend=backend, num_threads=3)
    assert [st.error() is None for st in states] == [True, True, True, False, True, True]
    assert "program 3 fails on purpose" in str(states[3].error())
    assert all(st["b"] is not None for i, st in enumerate(states) if i != 3)
    state = too_long_prog.run(backend=backend)
    err = state.error()
    assert isinstance(err, sgl.BackendError) and err.status_code == 400
    assert "context" in err.message.lower() or "longer than" in err.message.lower(), err.message
    with pytest.raises(sgl.BackendError):
        state["a"]
    with pytest.raises(NotImplementedError, match="text-only"):
        sgl.image("cat.png")
    # the runtime is unharmed and holds no KV for any of this
    load = wait_idle(Raw(backend))
    assert load["token_usage"] == 0.0


@sgl.function
def scope_prog(s, name, greeting):
    with s.var_scope("intro"):
        s += f"{greeting}, {name}. "
    copy = s.copy()
    copy += "In the copy." + sgl.gen("c", max_tokens=3, temperature=0)
    s += "In the original."
    s["copy_text"] = copy.text()
    with s.copy() as scoped:  # SGLang's form: the copy's new variables come back on exit
        scoped += " Scoped:" + sgl.gen("d", max_tokens=3, temperature=0)


def test_bind_var_scope_copy_and_default_backend(backend):
    bound = scope_prog.bind(greeting="Hello")
    with pytest.raises(TypeError, match="unknown argument"):
        scope_prog.bind(colour="red")
    sgl.set_default_backend(backend)
    try:
        state = bound.run(name="Ada")
    finally:
        sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="No backend"):
        bound.run(name="Ada")
    assert state["intro"] == "Hello, Ada. "
    assert state.text() == "Hello, Ada. In the original."
    assert state["copy_text"].startswith("Hello, Ada. In the copy.")
    assert "c" not in state  # a plain copy's variables stay in the copy
    assert isinstance(state["d"], list) and len(state["d"]) == 1
