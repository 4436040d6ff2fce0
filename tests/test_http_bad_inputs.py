"""Bad requests get a 4xx JSON error naming the problem (never a 500) and the server stays healthy.
Start-up mistakes are in tests/error_contract/test_startup_contract.py."""

from __future__ import annotations

import pytest
import requests

from server_utils import running_server

# The tiny llama: context length C = 2048, vocabulary 1024. The KV pool is capped at T = 1024 so
# the scheduler's own limit (max_req_input_len = min(C-1, T-1) - 5 = 1018) sits below C.
C, VOCAB = 2048, 1024


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--max-total-tokens", "1024", "--max-request-body-mb", "1") as handle:
        info = handle.get("/get_server_info").json()
        assert info["context_length"] == C and info["vocab_size"] == VOCAB
        handle.max_req_input_len = info["max_req_input_len"]
        yield handle


def hi(**sampling):
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **sampling}}


# (case id, method, path, body (dict/list/str -> JSON; bytes -> raw), status, substring of the message)
CASES = [
    # The body itself.
    ("malformed_json", "POST", "/generate", b'{"text": "hi",', 400, "The request body is not valid JSON"),
    ("nan_literal", "POST", "/generate", b'{"text": "hi", "sampling_params": {"temperature": NaN}}', 400,
     "not valid JSON"),
    ("empty_body", "POST", "/generate", b"", 400, "The request body is empty"),
    ("non_utf8", "POST", "/generate", b'{"text": "caf\xe9"}', 400, "not valid UTF-8: byte 0xe9 at position 13"),
    ("array_body", "POST", "/generate", [1, 2], 400, "The request body must be a JSON object, got list"),
    ("string_body", "POST", "/generate", "hello", 400, "must be a JSON object, got str"),
    # Top-level fields.
    ("unknown_field", "POST", "/generate", {"text": "hi", "prompt": "x"}, 400, "Unknown field 'prompt'"),
    ("unsupported_field", "POST", "/generate", {"text": "hi", "image_data": "x.png"}, 400,
     "'image_data' is not supported by this server (got \"x.png\"); leave it at its default null."),
    ("unsupported_sampling_param", "POST", "/generate", hi(beam_width=4), 400,
     "'beam_width' is not supported by this server (got 4); leave it at its default null."),
    ("neither_text_nor_ids", "POST", "/generate", {"sampling_params": {}}, 400,
     "Specify exactly one of 'text' or 'input_ids'."),
    ("both_text_and_ids", "POST", "/generate", {"text": "hi", "input_ids": [1, 2]}, 400, "not both"),
    ("empty_text", "POST", "/generate", {"text": ""}, 400, "text is empty: send a non-empty prompt"),
    ("empty_text_list", "POST", "/generate", {"text": []}, 400, "text is an empty list"),
    ("text_wrong_type", "POST", "/generate", {"text": 42}, 400, "text must be a string or a list of strings"),
    ("text_list_wrong_item", "POST", "/generate", {"text": ["a", 3]}, 400, "text[1] must be a string"),
    ("empty_input_ids", "POST", "/generate", {"input_ids": []}, 400, "input_ids is empty"),
    ("input_ids_not_ints", "POST", "/generate", {"input_ids": [1, "a"]}, 400,
     "input_ids must be a list of integer token ids"),
    ("token_id_above_vocab", "POST", "/generate", {"input_ids": [1, 5000]}, 400,
     "input_ids contains token id 5000 at position 1, outside the vocabulary [0, 1024)"),
    ("negative_token_id", "POST", "/generate", {"input_ids": [-1]}, 400, "input_ids contains token id -1"),
    ("stream_not_bool", "POST", "/generate", {"text": "hi", "stream": "yes"}, 400, "stream must be a boolean"),
    ("rid_not_string", "POST", "/generate", {"text": "hi", "rid": 5}, 400, "rid must be a non-empty string"),
    ("batch_rids_repeat", "POST", "/generate", {"text": ["a", "b"], "rid": ["x", "x"]}, 400,
     "rid entries of a batch must be distinct"),
    ("return_logprob_not_bool", "POST", "/generate", {"text": "hi", "return_logprob": "yes"}, 400,
     "return_logprob must be a boolean"),
    ("logprob_start_len_below_minus_one", "POST", "/generate", {"text": "hi", "logprob_start_len": -2}, 400,
     "logprob_start_len must be -1 (output tokens only) or a prompt position >= 0, got -2"),
    ("logprob_start_len_not_int", "POST", "/generate", {"text": "hi", "logprob_start_len": "0"}, 400,
     "logprob_start_len must be -1"),
    ("top_logprobs_num_negative", "POST", "/generate", {"text": "hi", "top_logprobs_num": -1}, 400,
     "top_logprobs_num must be an integer >= 0, got -1"),
    ("token_ids_logprob_above_vocab", "POST", "/generate", {"text": "hi", "token_ids_logprob": [99999]}, 400,
     "token_ids_logprob contains token id 99999"),
    ("sampling_params_list_for_single", "POST", "/generate", {"text": "hi", "sampling_params": [{}]}, 400,
     "sampling_params must be an object for a single prompt, got a list."),
    ("sampling_params_not_object", "POST", "/generate", {"text": "hi", "sampling_params": "greedy"}, 400,
     "sampling_params must be an object"),
    ("batch_params_length_mismatch", "POST", "/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400,
     "sampling_params has 1 entries but the batch has 2 prompts."),
    # Sampling parameters: unknown, wrong type, out of range (each parameter).
    ("unknown_sampling_param", "POST", "/generate", hi(max_tokens=3), 400, "Unknown sampling parameter 'max_tokens'"),
    ("temperature_negative", "POST", "/generate", hi(temperature=-1), 400,
     "temperature must be >= 0 and finite, got -1"),
    ("temperature_not_number", "POST", "/generate", hi(temperature="hot"), 400, "temperature must be a number"),
    ("top_p_zero", "POST", "/generate", hi(top_p=0), 400, "top_p must be in (0, 1], got 0"),
    ("top_p_above_one", "POST", "/generate", hi(top_p=1.5), 400, "top_p must be in (0, 1], got 1.5"),
    ("top_k_zero", "POST", "/generate", hi(top_k=0), 400, "top_k must be -1 (disabled) or >= 1, got 0"),
    ("top_k_float", "POST", "/generate", hi(top_k=1.5), 400, "top_k must be an integer, got 1.5"),
    ("min_p_above_one", "POST", "/generate", hi(min_p=2), 400, "min_p must be in [0, 1], got 2"),
    ("frequency_penalty_high", "POST", "/generate", hi(frequency_penalty=3), 400,
     "frequency_penalty must be in [-2, 2], got 3"),
    ("presence_penalty_low", "POST", "/generate", hi(presence_penalty=-3), 400,
     "presence_penalty must be in [-2, 2], got -3"),
    ("repetition_penalty_zero", "POST", "/generate", hi(repetition_penalty=0), 400,
     "repetition_penalty must be in (0, 2], got 0"),
    ("n_zero", "POST", "/generate", hi(n=0), 400, "n must be >= 1, got 0"),
    ("max_new_tokens_negative", "POST", "/generate", hi(max_new_tokens=-1), 400,
     "max_new_tokens must be >= 0, got -1"),
    ("max_new_tokens_string", "POST", "/generate", hi(max_new_tokens="ten"), 400,
     "max_new_tokens must be an integer, got 'ten'"),
    ("min_above_max_new_tokens", "POST", "/generate", hi(min_new_tokens=5), 400,
     "min_new_tokens must be in [0, max_new_tokens=4], got 5"),
    ("stop_empty_string", "POST", "/generate", hi(stop=""), 400, "stop must be a non-empty string"),
    ("stop_regex_invalid", "POST", "/generate", hi(stop_regex="("), 400,
     "stop_regex must be a regular expression RE2 can compile"),
    ("stop_regex_backreference", "POST", "/generate", hi(stop_regex=r"(a)\1"), 400,
     "stop_regex runs on RE2: no backreferences or lookarounds"),
    # Per-request work caps: each a 400 naming the field and the flag that changes it.
    ("top_logprobs_over_cap", "POST", "/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21},
     400, "top_logprobs_num holds 21 top logprobs per token, more than this server allows (20, --max-logprobs=20)"),
    ("top_logprobs_huge", "POST", "/generate", {"text": "hi", "top_logprobs_num": 10**9}, 400, "--max-logprobs=20"),
    ("token_ids_logprob_over_cap", "POST", "/generate", {"text": "hi", "token_ids_logprob": list(range(21))}, 400,
     "token_ids_logprob holds 21 token ids, more than this server allows (20, --max-logprobs=20)"),
    ("stop_count_over_cap", "POST", "/generate", hi(stop=[f"s{i}" for i in range(65)]), 400,
     "sampling_params.stop holds 65 entries, more than this server allows (64, --max-stop-sequences=64)"),
    ("stop_chars_over_cap", "POST", "/generate", hi(stop=["x" * 4000, "y" * 97]), 400,
     "sampling_params.stop holds 4097 characters in all, more than this server allows (4096, --max-stop-chars=4096)"),
    ("stop_regex_count_over_cap", "POST", "/generate", hi(stop_regex=[f"a{i}" for i in range(65)]), 400,
     "sampling_params.stop_regex holds 65 entries"),
    ("logit_bias_over_cap", "POST", "/generate", hi(logit_bias={str(i): 1 for i in range(4097)}),
     400, "sampling_params.logit_bias holds 4097 entries, more than this server allows (4096, --max-logit-bias=4096)"),
    ("rid_over_cap", "POST", "/generate", {"text": "hi", "rid": "r" * 513}, 400,
     "rid holds 513 characters, more than this server allows (512, --max-rid-length=512)"),
    ("chat_messages_over_cap", "POST", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "a"}] * 4097}, 400,
     "messages holds 4097 messages, more than this server allows (4096, --max-chat-messages=4096)"),
    ("chat_top_logprobs_over_cap", "POST", "/v1/chat/completions",
     {"model": "m", "messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs must be in [0, 20] (the upper bound is this server's --max-logprobs=20), got 21"),
    ("completion_logprobs_over_cap", "POST", "/v1/completions", {"model": "m", "prompt": "a", "logprobs": 21}, 400,
     "--max-logprobs=20"),
    ("json_items_over_cap", "POST", "/generate", b'{"text": "hi", "x": [' + b"[]," * 270000 + b'[]]}', 400,
     "The request body holds 270005 JSON objects, arrays and keys, more than one request may hold (262144, "
     "--max-request-json-items=262144)"),
    ("stop_token_ids_above_vocab", "POST", "/generate", hi(stop_token_ids=[5000]), 400,
     "stop_token_ids must hold token ids in [0, vocab_size=1024), got 5000"),
    ("logit_bias_bad_key", "POST", "/generate", hi(logit_bias={"abc": 1.0}), 400, "logit_bias keys must be token ids"),
    ("logit_bias_bad_value", "POST", "/generate", hi(logit_bias={"5": "x"}), 400,
     "logit_bias values must be finite numbers"),
    ("ignore_eos_not_bool", "POST", "/generate", hi(ignore_eos="yes"), 400, "ignore_eos must be a boolean"),
    ("sampling_seed_float", "POST", "/generate", hi(sampling_seed=1.5), 400,
     "sampling_seed must be an integer or null, got 1.5"),
    ("regex_does_not_compile", "POST", "/generate", hi(regex="[a-z"), 400,
     "sampling_params.regex does not compile"),
    ("json_schema_does_not_compile", "POST", "/generate", hi(json_schema="{"), 400,
     "sampling_params.json_schema does not compile"),
    # Lengths (non-streaming, with the full texts): tests/error_contract/test_request_contract.py.
    ("text_longer_than_context", "POST", "/generate", {"text": "hello " * 3000}, 400,
     "is longer than the model's context length (2048 tokens)."),
    # Streaming requests with bad input: a real status, before any SSE byte.
    ("stream_bad_param", "POST", "/generate", {"text": "hi", "stream": True, "sampling_params": {"top_p": 0}}, 400,
     "top_p must be in (0, 1]"),
    ("stream_too_long", "POST", "/generate", {"input_ids": [5] * C, "stream": True}, 400,
     "longer than the model's context length"),
    ("stream_scheduler_refusal", "POST", "/generate", {"input_ids": [5] * 1500, "stream": True}, 400,
     "exceeds the maximum allowed length"),
    # Routes and methods.
    ("unknown_route", "GET", "/nope", None, 404, "Not found: GET /nope is not a route of this server."),
    ("unknown_post_route", "POST", "/v2/generate", {"text": "hi"}, 404, "POST /v2/generate is not a route"),
    ("generate_with_get", "GET", "/generate", None, 405, "Method GET is not allowed for /generate; use POST"),
    ("flush_cache_with_delete", "DELETE", "/flush_cache", None, 405, "Method DELETE is not allowed for /flush_cache"),
    ("server_info_with_post", "POST", "/get_server_info", {}, 405, "Method POST is not allowed"),
    # Admin bodies.
    ("abort_without_target", "POST", "/abort_request", {}, 400, "Send 'rid' (a request id prefix) or 'abort_all': true."),
    ("abort_rid_not_string", "POST", "/abort_request", {"rid": 5}, 400, "rid must be a non-empty string"),
    ("abort_unknown_field", "POST", "/abort_request", {"id": "x"}, 400, "Unknown field 'id'"),
    ("abort_all_not_bool", "POST", "/abort_request", {"abort_all": "yes"}, 400, "abort_all must be a boolean"),
    ("abort_malformed_json", "POST", "/abort_request", b"{", 400, "not valid JSON"),
]


def _send(server, method, path, body, **kw):
    if isinstance(body, bytes):
        kw["data"] = body
    elif body is not None:
        kw["json"] = body
    return requests.request(method, server.url + path, timeout=60, **kw)


def test_table_has_at_least_40_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case,method,path,body,status,text", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_json_error(server, case, method, path, body, status, text):
    resp = _send(server, method, path, body)
    assert resp.status_code == status, resp.text
    assert resp.headers["Content-Type"].startswith("application/json")  # never an SSE stream, never HTML
    error = resp.json()["error"]
    assert text.format(max_req_input_len=server.max_req_input_len) in error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_body_over_the_cap_is_413(server):
    body = b'{"text": "' + b"a" * (2 * 2**20) + b'"}'
    resp = _send(server, "POST", "/generate", body)
    assert resp.status_code == 413
    assert "Request body too large" in resp.json()["error"]["message"]
    assert "--max-request-body-mb" in resp.json()["error"]["message"]


def test_chunked_body_over_the_cap_is_413(server):
    def chunks():
        yield b'{"text": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    resp = requests.post(server.url + "/generate", data=chunks(), timeout=60)
    assert resp.status_code == 413 and "Request body too large" in resp.json()["error"]["message"]


def test_server_is_healthy_after_all_bad_requests(server):
    assert server.get("/health_generate").status_code == 200
    info = server.get("/get_server_info").json()
    assert info["load"]["num_running_reqs"] == 0 and info["num_front_end_requests"] == 0
    good = server.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] == 2
    assert server.alive()


# ---------------------------------------------------------------------- start-up mistakes
# Port in use, bad flag values and a missing model path: tests/error_contract/test_startup_contract.py.


def test_no_model_path_uses_the_demo_model_or_says_how_to_build_it(monkeypatch, tmp_path, llama_model):
    import srt.server_args as sa

    monkeypatch.setattr(sa, "DEMO_MODEL_DIR", str(tmp_path / "demo_model"))
    with pytest.raises(ValueError, match="No --model-path given and the embedded demo model is missing: "
                                         "run scripts/train_demo_model.py"):
        sa.ServerArgs()
    monkeypatch.setattr(sa, "DEMO_MODEL_DIR", str(llama_model))
    args = sa.prepare_server_args([])
    assert args.model_path == str(llama_model) and args.tokenizer_path == str(llama_model)


def test_deeply_nested_body_is_a_400_not_a_500(server):
    deep = "[" * 900 + "]" * 900
    for path, body in (("/generate", '{"text": "hi", "rid": %s}' % deep),
                       ("/v1/completions", '{"prompt": "hi", "max_tokens": %s}' % deep)):
        resp = requests.post(server.url + path, data=body, headers={"Content-Type": "application/json"}, timeout=30)
        assert resp.status_code == 400, resp.text
        assert "levels deep" in resp.json()["error"]["message"]
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/generate", {"text": "hi", "stream": "s" * 500_000}, "stream"),
    ("/generate", {"text": "hi", "rid": [7] * 100_000}, "rid"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [""] + ["x" * 1000] * 200}}, "sampling_params"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "9" * 400_000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": ["b" * 300_000]}, "logit_bias"),
])
def test_error_messages_do_not_echo_huge_values(server, path, body, param):
    resp = requests.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 400, resp.text[:300]
    error = resp.json()["error"]
    assert len(error["message"]) < 400, error["message"][:500]
    assert param.split("[")[0] in error["message"] or error["param"] == param


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}], "ebnf": "root ::= ("},
     "ebnf"),
    ("/v1/completions", {"model": "m", "prompt": "a", "stop": [f"s{i}" for i in range(65)]}, "stop"),
    ("/generate", {"text": "a", "sampling_params": {"stop": [f"s{i}" for i in range(65)]}}, "sampling_params.stop"),
])
def test_refusals_name_the_field_as_the_route_spells_it(server, path, body, param):
    resp = requests.post(server.url + path, json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
