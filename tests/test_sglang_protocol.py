"""SGLang's own request types against our server: SGLang's router and clients forward every field of
`GenerateReqInput`, `SamplingParams`, `CompletionRequest` and `ChatCompletionRequest`, so each one is
accepted at its default; fields this server does not implement are refused by name at any other
value; fields SGLang does not define stay unknown; any `model` name is served; the router's probe
routes answer.

The field lists and defaults below are copied by hand from SGLang 0.5.23 (`managers/io_struct.py`,
`sampling/sampling_params.py`, `entrypoints/openai/protocol.py`): they are the specification, not
read from our code. One server (tiny Qwen2 with a ChatML template, CPU) serves the module.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from server_utils import ServerHandle, running_server

SERVED = "tiny-sglang-protocol"
CHAT = [{"role": "user", "content": "Say something about licenses."}]

# ---------------------------------------------------------------------- SGLang 0.5.23: fields and defaults
SAMPLING_DEFAULTS: Dict[str, Any] = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None, "temperature": 1.0,
    "top_p": 1.0, "top_k": 1 << 30, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "beam_width": None, "json_schema": None,
    "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None, "logit_bias": None,
    "sampling_seed": None, "custom_params": None, "watermark": None,
}

GENERATE_DEFAULTS: Dict[str, Any] = {
    "rid": None, "session_id": None, "text": None, "input_ids": None, "input_embeds": None, "image_data": None,
    "video_data": None, "audio_data": None, "mm_hashes": None, "mm_content_hashes": None,
    "use_audio_in_video": False, "video_config": None, "sampling_params": None, "watermark": None,
    "return_logprob": None, "logprob_start_len": None, "top_logprobs_num": None, "token_ids_logprob": None,
    "return_sampling_mask": None, "sampling_logprobs_mode": None, "return_text_in_logprobs": False,
    "return_flat_raw_top_logprobs": False, "return_flat_raw_output_top_logprobs": False,
    "return_flat_raw_top_logprobs_b64": False, "stream": False, "log_metrics": True, "return_hidden_states": False,
    "return_routed_experts": False, "routed_experts_start_len": 0, "return_indexer_topk": False,
    "modalities": None, "session_params": None, "lora_path": None, "lora_id": None, "custom_logit_processor": None,
    "positional_embed_overrides": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "bootstrap_pair_key": None, "decode_tp_size": None, "routed_dp_rank": None, "data_parallel_rank": None,
    "disagg_prefill_dp_rank": None, "routing_key": None, "conversation_id": None, "http_worker_ipc": None,
    "background": False, "require_reasoning": False, "max_thinking_tokens": None, "priority": None,
    "extra_key": None, "no_logs": False, "custom_labels": None, "return_bytes": False, "return_entropy": False,
    "return_prompt_token_ids": False, "external_trace_header": None, "received_time": None,
    "need_wait_for_mm_inputs": None, "num_items_assigned": None, "encoder_urls": None, "max_dynamic_patch": None,
    "min_dynamic_patch": None, "image_max_dynamic_patch": None, "video_max_dynamic_patch": None,
    "images_config": None, "mm_processor_kwargs": None, "multi_item_delimiter_indices": None,
    "token_indices_to_pool": None, "cache_salt": None, "kv_hints": None,
}

_PD_ROUTING = {"bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "routed_dp_rank": None,
               "disagg_prefill_dp_rank": None}
_OPENAI_SHARED = {
    "model": "default", "frequency_penalty": 0.0, "logit_bias": None, "n": 1, "presence_penalty": 0.0,
    "seed": None, "stop": None, "stream": False, "stream_options": None, "user": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "return_cached_tokens_details": False, "return_spec_tokens_details": False, "return_token_ids": False,
    "min_tokens": 0, "regex": None, "ebnf": None, "stop_token_ids": None, "stop_regex": None, "no_stop_trim": False,
    "ignore_eos": False, "skip_special_tokens": True, "lora_path": None, "session_id": None, "session_params": None,
    "response_format": None, "custom_params": None, "custom_logit_processor": None, "watermark": None,
    "images_config": None, "mm_processor_kwargs": None, "data_parallel_rank": None, "rid": None,
    "extra_key": None, "cache_salt": None, "priority": None,
}
COMPLETION_DEFAULTS: Dict[str, Any] = {
    **_PD_ROUTING, **_OPENAI_SHARED,
    "prompt": "Hello there", "best_of": None, "echo": False, "logprobs": None, "max_tokens": 16, "suffix": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "json_schema": None, "repetition_penalty": 1.0,
    "custom_labels": None,
}
CHAT_DEFAULTS: Dict[str, Any] = {
    **_PD_ROUTING, **_OPENAI_SHARED,
    "messages": CHAT, "logprobs": False, "top_logprobs": None, "max_tokens": None, "max_completion_tokens": None,
    "temperature": None, "top_p": None, "tools": None, "tool_choice": "auto", "parallel_tool_calls": True,
    "return_prompt_token_ids": False, "return_meta_info": False, "return_input_ids_in_sglext": False,
    "return_output_ids_in_sglext": False, "return_sampling_mask": False, "sampling_logprobs_mode": None,
    "return_flat_raw_output_top_logprobs": False, "return_flat_raw_top_logprobs_b64": True,
    "reasoning_effort": None, "thinking": None, "task": None, "top_k": None, "min_p": None,
    "repetition_penalty": None, "continue_final_message": False, "separate_reasoning": True,
    "stream_reasoning": True, "chat_template_kwargs": None, "max_dynamic_patch": None, "min_dynamic_patch": None,
    "use_audio_in_video": False, "video_config": None, "input_ids": None,
}

# SGLang fields this server takes at their default only, with a value that is not the default.
GENERATE_NON_DEFAULT: Dict[str, Any] = {
    "input_embeds": [[0.1, 0.2]], "image_data": "x.png", "video_data": "x.mp4", "audio_data": "x.wav",
    "mm_hashes": ["ab"], "mm_content_hashes": ["sha256:ab"], "use_audio_in_video": True,
    "video_config": {"fps": 2}, "watermark": {"enabled": True}, "return_sampling_mask": True,
    "sampling_logprobs_mode": "selected", "return_flat_raw_top_logprobs": True,
    "return_flat_raw_output_top_logprobs": True, "return_flat_raw_top_logprobs_b64": True, "log_metrics": False,
    "return_hidden_states": True, "return_routed_experts": True, "routed_experts_start_len": 2,
    "return_indexer_topk": True, "modalities": ["image"], "session_params": {"id": "s1"}, "lora_path": "adapter",
    "lora_id": "adapter-1", "custom_logit_processor": "{}", "positional_embed_overrides": {"0": [0.5]},
    "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7, "bootstrap_pair_key": "k",
    "decode_tp_size": 2, "routed_dp_rank": 0, "disagg_prefill_dp_rank": 0,
    "routing_key": "tenant-a", "http_worker_ipc": "ipc:///tmp/w", "background": True, "require_reasoning": True,
    "max_thinking_tokens": 64, "priority": 5, "no_logs": True, "return_bytes": True, "return_entropy": True,
    "return_prompt_token_ids": True, "external_trace_header": {"traceparent": "00-1-2-01"}, "received_time": 1.5,
    "need_wait_for_mm_inputs": True, "num_items_assigned": {"image": [1]}, "encoder_urls": ["http://enc"],
    "max_dynamic_patch": 6, "min_dynamic_patch": 1, "image_max_dynamic_patch": 6, "video_max_dynamic_patch": 6,
    "images_config": {"size": 1}, "mm_processor_kwargs": {"a": 1}, "multi_item_delimiter_indices": [3],
    "token_indices_to_pool": [1], "kv_hints": {"version": 1},
}
SAMPLING_NON_DEFAULT: Dict[str, Any] = {"beam_width": 4, "stream_interval": 8, "custom_params": {"bias": 1},
                                        "watermark": {"enabled": True}}
OPENAI_NON_DEFAULT: Dict[str, Any] = {  # both endpoints
    "return_hidden_states": True, "return_routed_experts": True, "routed_experts_start_len": 1,
    "return_cached_tokens_details": True, "return_spec_tokens_details": True, "return_token_ids": True,
    "lora_path": "adapter", "session_params": {"id": "s1"}, "custom_params": {"a": 1},
    "custom_logit_processor": "{}", "watermark": {"enabled": True}, "images_config": {"a": 1},
    "mm_processor_kwargs": {"a": 1}, "priority": 2, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
    "bootstrap_room": 3, "disagg_prefill_dp_rank": 1, "routed_dp_rank": 2,
}
COMPLETION_NON_DEFAULT: Dict[str, Any] = {**OPENAI_NON_DEFAULT, "best_of": 3, "suffix": " the end"}
CHAT_NON_DEFAULT: Dict[str, Any] = {
    **OPENAI_NON_DEFAULT, "return_prompt_token_ids": True, "return_meta_info": True,
    "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True, "return_sampling_mask": True,
    "sampling_logprobs_mode": "support", "return_flat_raw_output_top_logprobs": True,
    "return_flat_raw_top_logprobs_b64": False, "reasoning_effort": "high", "thinking": {"type": "enabled"},
    "task": "query", "max_dynamic_patch": 4, "min_dynamic_patch": 1, "use_audio_in_video": True,
    "video_config": {"fps": 1},
}
# Structured output and tools are implemented; OpenAI's legacy function-calling fields are not.
STRUCTURED_OR_TOOLS = {"/v1/chat/completions": {"functions": [{"name": "f"}], "function_call": "auto"}}


# ---------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(qwen2_model: Path) -> Iterator[ServerHandle]:
    with running_server(qwen2_model, "--served-model-name", SERVED) as handle:
        yield handle


@pytest.fixture(scope="module")
def tokenizer(qwen2_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen2_model))


def ok(resp) -> Any:
    assert resp.status_code == 200, resp.text
    return resp.json()


def refusal(resp) -> Dict[str, Any]:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


def chat_body(**fields: Any) -> Dict[str, Any]:
    return {"model": SERVED, "messages": CHAT, "max_tokens": 4, **fields}


def completion_body(**fields: Any) -> Dict[str, Any]:
    return {"model": SERVED, "prompt": "Hello there", "max_tokens": 4, **fields}


# ---------------------------------------------------------------------- our tables cover SGLang's fields
def test_our_field_tables_cover_every_sglang_field():
    from managers.generate_input import GENERATE_FIELDS
    from srt.entrypoints.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS
    from srt.sampling.sampling_params import SAMPLING_FIELDS

    assert set(GENERATE_FIELDS) == set(GENERATE_DEFAULTS) | {"model"}  # sglang-router adds `model`
    assert set(SAMPLING_FIELDS) == set(SAMPLING_DEFAULTS)
    assert set(COMPLETION_DEFAULTS) <= set(COMPLETION_FIELDS)
    assert set(CHAT_DEFAULTS) | {"reasoning"} <= set(CHAT_FIELDS)
    # Beyond SGLang's protocol: only our /generate spelling and OpenAI's own chat fields.
    assert set(COMPLETION_FIELDS) - set(COMPLETION_DEFAULTS) == {"spaces_between_special_tokens"}
    assert set(CHAT_FIELDS) - set(CHAT_DEFAULTS) == {
        "spaces_between_special_tokens", "reasoning", "functions", "function_call", "audio", "modalities",
        "prediction", "store", "metadata", "service_tier", "web_search_options", "verbosity"}


# ---------------------------------------------------------------------- every field at its default
def test_every_sglang_generate_field_is_accepted_at_its_default(server):
    """The whole GenerateReqInput and SamplingParams, as a router forwards them (a short output)."""
    body = {**GENERATE_DEFAULTS, "text": "Hello there",
            "sampling_params": {**SAMPLING_DEFAULTS, "max_new_tokens": 4}}
    out = ok(server.post("/generate", json=body))
    assert out["meta_info"]["completion_tokens"] <= 4 and isinstance(out["text"], str)


def test_sampling_params_at_sglang_defaults_decode_128_tokens(server):
    params = {**SAMPLING_DEFAULTS, "ignore_eos": True}
    out = ok(server.post("/generate", json={"text": "Hello there", "sampling_params": params}))
    assert out["meta_info"]["completion_tokens"] == 128


def test_null_means_the_default_for_every_generate_field(server):
    body = {name: None for name in GENERATE_DEFAULTS}
    body.update(text="Hello there", sampling_params={**{n: None for n in SAMPLING_DEFAULTS}, "max_new_tokens": 3})
    out = ok(server.post("/generate", json=body))
    assert out["meta_info"]["completion_tokens"] <= 3


def test_every_sglang_completion_field_is_accepted_at_its_default(server):
    out = ok(server.post("/v1/completions", json=COMPLETION_DEFAULTS))
    assert out["object"] == "text_completion" and out["model"] == SERVED
    assert out["usage"]["completion_tokens"] <= 16 and isinstance(out["choices"][0]["text"], str)


def test_every_sglang_chat_field_is_accepted_at_its_default(server):
    # max_tokens is the one field set: its default (the rest of the context) decodes for long on CPU.
    out = ok(server.post("/v1/chat/completions", json={**CHAT_DEFAULTS, "max_tokens": 6}))
    assert out["object"] == "chat.completion" and out["model"] == SERVED
    assert out["usage"]["completion_tokens"] <= 6 and out["choices"][0]["message"]["role"] == "assistant"


def test_tool_choice_none_and_stream_options_defaults_are_accepted(server):
    ok(server.post("/v1/chat/completions", json=chat_body(tool_choice="none", parallel_tool_calls=False)))
    resp = server.post("/v1/completions", json=completion_body(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": False}))
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/event-stream")


# ---------------------------------------------------------------------- other values are refused by name
@pytest.mark.parametrize("field", sorted(GENERATE_NON_DEFAULT))
def test_generate_default_only_field_with_another_value_is_400_naming_it(server, field):
    value = GENERATE_NON_DEFAULT[field]
    error = refusal(server.post("/generate", json={"text": "Hello", field: value}))
    assert error["message"].startswith(f"'{field}' is not supported by this server (got {json.dumps(value)}); "
                                       f"leave it at its default ")
    assert error["param"] == field and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("field", sorted(SAMPLING_NON_DEFAULT))
def test_sampling_param_taken_at_default_only_is_400_naming_it(server, field):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, field: SAMPLING_NON_DEFAULT[field]}}
    error = refusal(server.post("/generate", json=body))
    assert error["message"].startswith(f"'{field}' is not supported by this server (got ")
    assert error["message"].endswith("leave it at its default null.")


@pytest.mark.parametrize("endpoint,field", [("/v1/completions", f) for f in sorted(COMPLETION_NON_DEFAULT)]
                         + [("/v1/chat/completions", f) for f in sorted(CHAT_NON_DEFAULT)])
def test_openai_default_only_field_with_another_value_is_400_naming_it(server, endpoint, field):
    table = COMPLETION_NON_DEFAULT if endpoint == "/v1/completions" else CHAT_NON_DEFAULT
    body = (completion_body if endpoint == "/v1/completions" else chat_body)(**{field: table[field]})
    error = refusal(server.post(endpoint, json=body))
    assert error["message"].startswith(f"'{field}' is not supported by this server (got ")
    assert "leave it at its default" in error["message"] and error["param"] == field


@pytest.mark.parametrize("endpoint,field", [(e, f) for e, fields in STRUCTURED_OR_TOOLS.items() for f in fields])
def test_openai_structured_output_and_tool_fields_keep_their_not_yet_message(server, endpoint, field):
    body = (completion_body if endpoint == "/v1/completions" else chat_body)(
        **{field: STRUCTURED_OR_TOOLS[endpoint][field]})
    error = refusal(server.post(endpoint, json=body))
    assert error["message"] == (f"'{field}' is not supported by this server yet ({endpoint}); remove it from the "
                                f"request.")
    assert error["param"] == field


def test_continuous_usage_stats_is_taken_at_its_default_only(server):
    body = completion_body(stream=True, stream_options={"continuous_usage_stats": True})
    error = refusal(server.post("/v1/completions", json=body))
    assert error["message"].startswith("'stream_options.continuous_usage_stats' is not supported by this server "
                                       "(got true)")


@pytest.mark.parametrize("endpoint,body", [
    ("/generate", {"text": "Hello", "not_a_field": 1}),
    ("/v1/completions", completion_body(not_a_field=1)),
    ("/v1/chat/completions", chat_body(not_a_field=1)),
])
def test_field_sglang_does_not_define_is_still_an_unknown_field(server, endpoint, body):
    error = refusal(server.post(endpoint, json=body))
    assert error["message"].startswith("Unknown field 'not_a_field'") and error["param"] == "not_a_field"


def test_sglang_internal_sampling_fields_are_not_api(server):
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 2, "stop_strs": ["x"]}}
    assert "Unknown sampling parameter 'stop_strs'" in refusal(server.post("/generate", json=body))["message"]


@pytest.mark.parametrize("endpoint,body,field", [
    ("/generate", {"text": "Hello", "session_id": 5}, "session_id"),
    ("/generate", {"text": "Hello", "custom_labels": "x"}, "custom_labels"),
    ("/v1/chat/completions", chat_body(separate_reasoning="yes"), "separate_reasoning"),
    ("/v1/completions", completion_body(user=7), "user"),
])
def test_inert_fields_are_still_type_checked(server, endpoint, body, field):
    error = refusal(server.post(endpoint, json=body))
    assert error["message"].startswith(f"{field} must be ") and error["param"] == field


# ---------------------------------------------------------------------- implemented fields
def test_any_model_name_is_served_and_the_served_name_reported(server):
    for model in ("default", "no-such-model", "org/other-model", None):
        completion = ok(server.post("/v1/completions", json=completion_body(model=model)))
        chat = ok(server.post("/v1/chat/completions", json=chat_body(model=model)))
        assert completion["model"] == chat["model"] == SERVED
    assert refusal(server.post("/v1/completions", json=completion_body(model=5)))["param"] == "model"
    native = ok(server.post("/generate", json={"text": "Hi", "model": "any", "sampling_params": {"max_new_tokens": 2}}))
    assert native["meta_info"]["completion_tokens"] == 2


def test_data_parallel_rank_is_honoured_within_the_replicas(server):
    """Implemented on /generate (sglang-router --dp-aware names a replica): 0 is this server's
    only replica; a rank past --dp-size is a 400 naming the field and the range."""
    ok(server.post("/generate", json={"text": "Hi", "data_parallel_rank": 0, "sampling_params": {"max_new_tokens": 1}}))
    error = refusal(server.post("/generate", json={"text": "Hi", "data_parallel_rank": 1}))
    assert error["message"] == "data_parallel_rank must be in [0, 1) for this server (--dp-size 1), got 1."
    assert error["param"] == "data_parallel_rank"
    assert refusal(server.post("/generate", json={"text": "Hi", "data_parallel_rank": -1}))["param"] == \
        "data_parallel_rank"
    for endpoint, body in (("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)):
        ok(server.post(endpoint, json=body(data_parallel_rank=0)))
        assert refusal(server.post(endpoint, json=body(data_parallel_rank=1)))["param"] == "data_parallel_rank"


def test_caller_ids_and_labels_pass_through_generate(server):
    body = {"text": ["Hello", "World"], "rid": ["b-0", "b-1"], "session_id": "s", "conversation_id": "c",
            "custom_labels": {"team": "a"}, "sampling_params": {"max_new_tokens": 2}}
    outs = ok(server.post("/generate", json=body))
    assert [o["meta_info"]["id"] for o in outs] == ["b-0", "b-1"]


def test_openai_rid_becomes_the_response_id(server):
    rid = f"client-{uuid.uuid4().hex}"
    assert ok(server.post("/v1/chat/completions", json=chat_body(rid=rid)))["id"] == rid
    assert ok(server.post("/v1/completions", json=completion_body(rid=rid + "-c")))["id"] == rid + "-c"
    # A batch of prompts under one string rid: SGLang names them <rid>_<i>; the response takes the first.
    batch = ok(server.post("/v1/completions", json=completion_body(prompt=["Hello", "World"], rid=rid + "-b")))
    assert batch["id"] == rid + "-b_0" and [c["index"] for c in batch["choices"]] == [0, 1]


def test_chat_input_ids_replace_the_rendered_prompt(server):
    out = ok(server.post("/v1/chat/completions", json=chat_body(input_ids=[5, 6, 7, 8, 9])))
    assert out["usage"]["prompt_tokens"] == 5


def test_continue_final_message_continues_the_assistant_text(server, tokenizer):
    prefix = "The license says"
    messages = CHAT + [{"role": "assistant", "content": prefix}]
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True, "cache_salt": uuid.uuid4().hex}
    cont = ok(server.post("/v1/chat/completions", json=chat_body(messages=messages, continue_final_message=True,
                                                                 **greedy)))
    # The oracle: the user turn rendered with the generation prompt, then the prefix's tokens.
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False) + tokenizer.encode(prefix, add_special_tokens=False)
    native = ok(server.post("/generate", json={"input_ids": ids, "cache_salt": uuid.uuid4().hex, "sampling_params": {
        "temperature": 0, "max_new_tokens": 6, "ignore_eos": True}}))
    assert cont["usage"]["prompt_tokens"] == len(ids)
    assert cont["choices"][0]["message"]["content"] == native["text"]
    closed = ok(server.post("/v1/chat/completions", json=chat_body(messages=messages, **greedy)))
    assert closed["usage"]["prompt_tokens"] != len(ids)  # without it the assistant turn is closed


def test_stop_regex_stops_openai_requests(server):
    base = completion_body(prompt="Once upon a time", max_tokens=16, temperature=0, ignore_eos=True)
    full = ok(server.post("/v1/completions", json={**base, "cache_salt": uuid.uuid4().hex}))["choices"][0]["text"]
    assert len(full) > 6, full
    stopped = ok(server.post("/v1/completions", json={**base, "cache_salt": uuid.uuid4().hex,
                                                      "stop_regex": re.escape(full[3:6])}))["choices"][0]
    assert stopped["finish_reason"] == "stop" and len(stopped["text"]) < len(full)
    assert full.startswith(stopped["text"])


def test_extra_key_separates_prefix_cache_namespaces(server):
    prompt = f"A prompt about warranties {uuid.uuid4().hex} and liability " * 3

    def cached(extra_key: str) -> int:
        out = ok(server.post("/v1/completions", json=completion_body(prompt=prompt, extra_key=extra_key)))
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


# ---------------------------------------------------------------------- routes the router probes
def test_model_info_and_server_info_answer_like_their_get_forms(server):
    assert ok(server.get("/model_info")) == ok(server.get("/get_model_info"))
    short, long_ = ok(server.get("/server_info")), ok(server.get("/get_server_info"))
    assert set(short) == set(long_)
    for key in ("model_path", "served_model_name", "max_total_num_tokens", "context_length", "version"):
        assert short[key] == long_[key], key
    assert short["served_model_name"] == SERVED


def test_get_load_reports_one_idle_rank_and_ready_is_200(server):
    [load] = ok(server.get("/get_load"))
    assert load["dp_rank"] == 0 and load["num_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert isinstance(load["num_tokens"], int) and load["num_tokens"] >= 0
    assert server.get("/ready").status_code == 200
