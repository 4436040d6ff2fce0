"""Request-time rows of the error contract, on one real server whose KV pool is smaller than the
context length, so both guards are visible: the tokenizer manager checks the context length C,
the scheduler checks max_req_input_len (from the KV pool) and whole pages of the pool.

Server: tiny llama, --context-length 512, --max-total-tokens 256, --page-size 16, so
T = 256, max_req_len = min(C-1, T-1) = 255 and max_req_input_len = 255 - 5 = 250.
"""

from __future__ import annotations

import pytest

from server_utils import running_server

C, T, PAGE = 512, 256, 16
MAX_REQ_INPUT_LEN = min(C - 1, T - 1) - 5


@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--context-length", str(C), "--max-total-tokens", str(T),
                        "--page-size", str(PAGE)) as handle:
        yield handle


def refusal(resp, status=400):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def model_name(server):
    return server.get("/v1/models").json()["data"][0]["id"]


def generate(server, n_tokens, **sampling):
    return server.post("/generate", json={"input_ids": [5] * n_tokens,
                                          "sampling_params": {"max_new_tokens": 2, **sampling}})


def test_limits_are_reported_where_users_look(server):
    info = server.get("/get_server_info").json()
    limits = (info["context_length"], info["max_total_num_tokens"], info["max_req_input_len"])
    assert limits == (C, T, MAX_REQ_INPUT_LEN)
    assert info["kv_budget"]["total_bound"] == f"--max-total-tokens={T}"
    assert info["kv_budget"]["input_bound"] == f"KV pool of T={T} tokens"
    # /v1/models reports the length a request can really use (the vLLM guide's first check): the
    # scheduler's input cap, so every prompt + completion within it runs as asked.
    assert server.get("/v1/models").json()["data"][0]["max_model_len"] == MAX_REQ_INPUT_LEN
    assert server.get("/get_model_info").json()["context_length"] == C
    # And the start-up log said so, with the flags that raise it.
    assert (f"Requests longer than max_req_input_len={MAX_REQ_INPUT_LEN} tokens will be refused, below the model's "
            f"context length C={C}, because the KV pool holds only T={T} tokens (--max-total-tokens={T})."
            in server.logs())
    assert "raise --mem-fraction-static or --max-total-tokens" in server.logs()


def test_input_at_the_context_length_is_refused_by_the_tokenizer_manager(server):
    error = refusal(generate(server, C))
    assert error["message"] == (f"The input ({C} tokens) is longer than the model's context length ({C} tokens). "
                                f"Use a shorter input, or start the server with --allow-auto-truncate to keep the "
                                f"first {C - 1} tokens.")
    assert error["code"] == "context_length_exceeded"


def test_input_plus_explicit_max_new_tokens_over_the_context_is_refused(server):
    error = refusal(generate(server, 200, max_new_tokens=C - 200))
    assert error["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {C} tokens. You requested a total "
        f"of {C} tokens: 200 tokens from the input messages and {C - 200} tokens for the completion.")
    assert error["code"] == "context_length_exceeded"
    # One token less fits the context; the scheduler then clamps max_new_tokens to the KV pool.
    ok = generate(server, 200, max_new_tokens=C - 201, ignore_eos=True)
    assert ok.status_code == 200
    assert ok.json()["meta_info"]["completion_tokens"] == (T - 1) - 200 - 1


def test_input_below_the_context_but_over_the_kv_pool_is_refused_by_the_scheduler(server):
    """Two guards, two limits: 300 < C passes the tokenizer manager, 300 >= max_req_input_len does not."""
    L = 300
    assert L < C and L >= MAX_REQ_INPUT_LEN
    error = refusal(generate(server, L))
    assert error["message"] == (
        f"Input length ({L} tokens) exceeds the maximum allowed length ({MAX_REQ_INPUT_LEN} tokens). Use a shorter "
        f"input or enable --allow-auto-truncate. The limit comes from the KV cache pool ({T} tokens), not the "
        f"model's context length ({C} tokens): raise --mem-fraction-static or --max-total-tokens, or use "
        f"--kv-cache-dtype fp8_e4m3, to accept longer inputs.")
    assert error["code"] == "context_length_exceeded"
    # The same request streamed gets the same status before any SSE byte.
    streamed = server.post("/generate", json={"input_ids": [5] * L, "stream": True})
    assert refusal(streamed)["message"] == error["message"]


def test_prompt_filling_the_last_pages_of_the_pool_is_served(server):
    """245 tokens take 16 pages of 16 = all of T; the 9 decode tokens fit the last page's free slots.
    (The "Request prompt exceeds the KV memory budget" guard: tests/error_contract/test_running_contract.py.)"""
    L = 245
    resp = generate(server, L, max_new_tokens=100, ignore_eos=True)
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == (T - 1) - L - 1  # clamped to max_req_len


@pytest.mark.parametrize("part,what", [({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                         "image_url"),
                                        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                         "input_audio")])
def test_content_part_a_text_model_cannot_take_is_400(server, part, what):
    body = {"model": model_name(server), "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
    error = refusal(server.post("/v1/chat/completions", json=body))
    assert error["message"].startswith(f"messages[0].content[1] is a content part of type '{what}', but this "
                                       f"model accepts text only")
    assert error["param"] == "messages"


def test_server_keeps_serving_after_every_refusal(server):
    assert server.alive()
    assert server.get("/health_generate").status_code == 200
    load = server.get("/get_server_info").json()["load"]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    ok = server.post("/v1/chat/completions", json={"model": model_name(server), "max_tokens": 3,
                                                   "messages": [{"role": "user", "content": "Hi"}]})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    # The scheduler checks KV conservation whenever it is idle and stops on a leak: still alive.
    assert server.get("/health").status_code == 200 and server.alive()
