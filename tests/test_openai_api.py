"""The OpenAI-compatible API driven by the real `openai` SDK against a real server process.

One server (tiny Qwen2 model with a ChatML template, CPU, float32) serves the whole module.
Greedy requests (temperature 0) are deterministic, so streamed text can be compared with the
non-streamed text of the same request.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
from server_utils import ServerHandle, running_server, sse_events

SERVED_NAME = "tiny-qwen2"
GREEDY = {"temperature": 0}
CHAT = [{"role": "user", "content": "Say something about licenses."}]


# ---------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(qwen2_model: Path) -> Iterator[ServerHandle]:
    with running_server(qwen2_model, "--served-model-name", SERVED_NAME) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "x", max_retries=0, timeout=120)


def _salt() -> dict:
    """A fresh prefix-cache namespace: the request cannot hit anything cached before it."""
    return {"cache_salt": uuid.uuid4().hex}


def _fresh() -> dict:
    """extra_body for runs compared token by token: no cache hits, so every run computes the same
    full prefill (a cached prefix takes another numeric path), and no early EOS."""
    return {"ignore_eos": True, **_salt()}


def _usage_dict(usage: Any) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens}


# ---------------------------------------------------------------------- chat
def test_chat_completion_shape_and_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=8, **GREEDY)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion" and resp.model == SERVED_NAME and resp.created > 0
    [choice] = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens <= 8 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert isinstance(resp.usage.prompt_tokens_details.cached_tokens, int)


def test_chat_length_finish_reports_length_and_null_matched_stop(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_completion_tokens=4,
                                          extra_body={"ignore_eos": True}, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 4
    assert choice.model_extra["matched_stop"] is None


def test_chat_stream_matches_non_stream_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=12, **GREEDY)
    full = client.chat.completions.create(extra_body=_fresh(), **kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, extra_body=_fresh(), **kwargs))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_include_usage_sends_final_usage_chunk(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, messages=CHAT, max_tokens=6, extra_body={"ignore_eos": True, **_salt()},
                  **GREEDY)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert last.usage.completion_tokens == 6
    again = client.chat.completions.create(**kwargs)  # same salt: an exact repeat
    assert again.usage.prompt_tokens == last.usage.prompt_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_n2_returns_two_indexed_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=5, n=2, temperature=1.0,
                                          seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 10
    single = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens  # counted once per prompt


def test_chat_stream_n2_streams_both_choices(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=5, n=2,
                                                 stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason}
    assert finished == {0: "length", 1: "length"}
    roles = {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"}
    assert roles == {0, 1}


def test_chat_logprobs_with_top_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=5, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the top token


def test_chat_stream_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=6, logprobs=True,
                                                 stream=True, extra_body={"ignore_eos": True}, **GREEDY))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 6 and all(e.top_logprobs == [] for e in entries)


def test_stop_string_cuts_output_and_reports_matched_stop(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="The license grants", max_tokens=24, **GREEDY)
    text = client.completions.create(extra_body=_fresh(), **kwargs).choices[0].text
    stripped = text.strip()
    assert len(stripped) >= 6, f"need a longer greedy output to pick a stop string from: {text!r}"
    start = text.index(stripped[len(stripped) // 2:])
    stop = text[start:start + 2]
    resp = client.completions.create(stop=[stop, "never-appears-xyz"], extra_body=_fresh(), **kwargs)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["matched_stop"] == stop
    assert choice.text == text[: text.index(stop)]


# ---------------------------------------------------------------------- completions
def test_completion_shape_and_stream_equivalence(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="Permission is hereby granted", max_tokens=10, **GREEDY)
    resp = client.completions.create(extra_body=_fresh(), **kwargs)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 10
    chunks = list(client.completions.create(stream=True, extra_body=_fresh(), **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=SERVED_NAME, prompt="Hello", extra_body={"ignore_eos": True}, **GREEDY)
    assert resp.usage.completion_tokens == 16


def test_completion_batch_prompts_with_n2(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=SERVED_NAME, prompt=["First prompt", "Second one"], n=2, max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.completion_tokens == 12


def test_completion_logprobs_legacy_shape(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=SERVED_NAME, prompt="The software is provided", max_tokens=5,
                                     logprobs=2, extra_body={"ignore_eos": True}, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 2
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_completion_echo_with_prompt_logprobs(client: openai.OpenAI) -> None:
    prompt = "Copyright notice"
    resp = client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=0,
                                     extra_body={"ignore_eos": True}, **GREEDY)
    choice = resp.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert len(lp.tokens) == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])


def test_completion_echo_with_prompt_top_logprobs(client: openai.OpenAI) -> None:
    prompt = "Copyright notice and permission"
    kwargs = dict(model=SERVED_NAME, prompt=prompt, max_tokens=2, echo=True, logprobs=2,
                  extra_body={"ignore_eos": True}, **GREEDY)
    resp = client.completions.create(**kwargs)
    lp = resp.choices[0].logprobs
    n_prompt = resp.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.top_logprobs) == n_prompt + resp.usage.completion_tokens
    assert lp.top_logprobs[0] is None  # the first prompt token has no context
    for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert logprob <= max(top.values()) + 1e-5  # the top-k bound every token's own logprob
    streamed = list(client.completions.create(stream=True, **kwargs))
    tops = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.top_logprobs]
    assert tops == lp.top_logprobs


def test_usage_cached_tokens_zero_first_then_positive_on_repeat(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="A fresh prompt about warranties and liability " * 3, max_tokens=4,
                  extra_body={"ignore_eos": True, **_salt()}, **GREEDY)
    first = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(**kwargs)
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens


def test_stream_and_non_stream_usage_are_identical(client: openai.OpenAI) -> None:
    kwargs = dict(model=SERVED_NAME, prompt="Redistribution and use in source", max_tokens=5,
                  extra_body={"ignore_eos": True}, **GREEDY)
    client.completions.create(**kwargs)  # warm the cache so both measured requests hit it alike
    plain = client.completions.create(**kwargs).usage
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == []
    assert _usage_dict(chunks[-1].usage) == _usage_dict(plain)


# ---------------------------------------------------------------------- models
def test_models_list_reports_lengths(client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == SERVED_NAME and card.object == "model" and card.owned_by and card.created > 0
    extra = card.model_extra
    assert 0 < extra["max_model_len"] <= extra["context_length"]
    assert 0 < extra["max_req_input_len"] <= extra["max_model_len"]
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME


def test_unknown_model_id_is_404_on_the_models_route(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found" and "no-such-model" in err.value.message


def test_any_model_name_is_served_under_the_served_name(client: openai.OpenAI) -> None:
    """As with SGLang, `model` does not select anything: the response names the served model."""
    resp = client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert resp.model == SERVED_NAME and resp.usage.completion_tokens >= 1


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize("extra, field", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"regex": "[a-z"}, "regex"),  # a top-level field of the OpenAI body
    ({"lora_path": "adapter-a"}, "lora_path"),
    ({"not_a_field": 1}, "not_a_field"),
])
def test_unsupported_or_unknown_field_is_400_naming_it(client: openai.OpenAI, extra: dict, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=2, extra_body=extra)
    assert field in err.value.message and err.value.param == field
    assert err.value.body["type"] == "invalid_request_error"


def test_completions_refuses_suffix(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=SERVED_NAME, prompt="x", suffix="tail", max_tokens=2)


def test_prompt_over_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    limit = client.models.retrieve(SERVED_NAME).model_extra["context_length"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=SERVED_NAME, prompt=[5] * (limit + 8), max_tokens=2)
    assert err.value.code == "context_length_exceeded"
    assert "longer than the model's context length" in err.value.message


def test_max_tokens_over_context_is_context_length_exceeded(client: openai.OpenAI) -> None:
    limit = client.models.retrieve(SERVED_NAME).model_extra["context_length"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=SERVED_NAME, messages=CHAT, max_tokens=limit)
    assert err.value.code == "context_length_exceeded"
    assert "maximum context length" in err.value.message


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=True
    ({"messages": []}, "messages"),
])
def test_streaming_request_with_bad_input_gets_real_400(client: openai.OpenAI, kwargs: dict, field: str) -> None:
    args = dict(model=SERVED_NAME, messages=CHAT, max_tokens=2, stream=True)
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert field in err.value.message


def test_stream_options_without_stream_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.completions.create(model=SERVED_NAME, prompt="x", max_tokens=2, stream_options={"include_usage": True})


def test_raw_sse_framing_ends_with_done(server: ServerHandle) -> None:
    resp = server.post("/v1/chat/completions", stream=True,
                       json={"messages": CHAT, "max_tokens": 3, "stream": True, "ignore_eos": True})
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads and all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_raw_malformed_json_is_400_in_openai_shape(server: ServerHandle) -> None:
    resp = server.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]


def test_client_disconnect_mid_stream_aborts_request(server: ServerHandle) -> None:
    before = server.get("/get_server_info").json()["load"]["counters"]
    resp = server.post("/v1/chat/completions", stream=True, json={
        "messages": CHAT, "max_tokens": 1500, "stream": True, "ignore_eos": True, **_salt()})
    assert resp.status_code == 200
    assert next(line for line in resp.iter_lines() if line).startswith(b"data: ")
    resp.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = server.get("/get_server_info").json()
        if info["num_front_end_requests"] == 0 and info["load"]["num_running_reqs"] == 0:
            break
        time.sleep(0.2)
    counters = info["load"]["counters"]
    assert info["num_front_end_requests"] == 0 and info["load"]["num_running_reqs"] == 0, info["load"]
    assert counters["num_aborts"] == before["num_aborts"] + 1
    assert counters["generated_tokens"] - before["generated_tokens"] < 1500  # stopped early, not finished


def test_server_healthy_after_errors(server: ServerHandle, client: openai.OpenAI) -> None:
    assert server.get("/health").status_code == 200
    assert client.completions.create(model=SERVED_NAME, prompt="ok", max_tokens=1).usage.completion_tokens == 1
