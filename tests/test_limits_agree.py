"""One source of truth for a request's length limits (issue 15, item 10): `/v1/models`'
`max_model_len`, admission's refusal threshold and the max_new_tokens clamp all come from
`RequestLimits`, and every clamp is reported (meta_info and the finish reason).

Server: tiny llama, --context-length 512, --max-total-tokens 256, so T = 256 binds:
max_req_len = min(C-1, T-1) = 255, max_req_input_len = 250 = max_model_len, and a request may
hold 254 tokens (prompt + completion).
"""

from __future__ import annotations

import asyncio
from typing import Any, List

import pytest

from managers.generate_input import GenerateReqInput, RequestLimits
from managers.io_struct import BatchStrOut, SchedulerReady, TokenizedGenerateReqInput
from managers.tokenizer_manager import TokenizerManager
from server_utils import running_server
from srt.server_args import ServerArgs
from srt.utils.hf_transformers_utils import get_tokenizer

C, T = 512, 256
MAX_REQ_LEN = min(C - 1, T - 1)
MAX_MODEL_LEN = MAX_REQ_LEN - 5
GREEDY = {"temperature": 0, "ignore_eos": True}


def info(context_len: int = C, total: int = T) -> SchedulerReady:
    max_req_len = min(context_len - 1, total - 1)
    return SchedulerReady(ok=True, max_total_num_tokens=total, max_req_input_len=max_req_len - 5,
                          max_req_len=max_req_len, max_running_requests=8, context_len=context_len, vocab_size=1024)


# ---------------------------------------------------------------- the arithmetic
def test_limits_follow_admissions_arithmetic():
    limits = RequestLimits.from_scheduler_info(info())
    assert limits.max_model_len == MAX_MODEL_LEN == 250
    assert limits.max_total_tokens == MAX_REQ_LEN - 1 == 254
    assert limits.max_new_tokens_for(200) == 54 and limits.max_new_tokens_for(300) == 0
    assert "KV cache pool (256 tokens" in limits.bound() and "--max-total-tokens" in limits.bound()
    assert "context length (512 tokens)" in RequestLimits.from_scheduler_info(info(total=4096)).bound()


def test_every_split_of_max_model_len_is_served_unclamped():
    limits = RequestLimits.from_scheduler_info(info())
    for L in range(1, limits.max_model_len):  # admission takes L < max_req_input_len
        assert L < limits.max_req_input_len
        assert limits.max_new_tokens_for(L) >= limits.max_model_len - L


# ---------------------------------------------------------------- the front door (fake scheduler)
class EchoLength:
    """Answers each request with a length finish at its max_new_tokens, as admission would."""

    def __init__(self) -> None:
        self.sent: List[Any] = []
        self.tm: Any = None

    def __call__(self, msg: Any) -> None:
        self.sent.append(msg)
        if isinstance(msg, TokenizedGenerateReqInput):
            asyncio.get_running_loop().call_soon(self.answer, msg)

    def answer(self, req: TokenizedGenerateReqInput) -> None:
        k = req.sampling_params.max_new_tokens
        self.tm.handle_batch_str_out(BatchStrOut([req.rid], ["x"], [[5] * k], [{"type": "length", "length": k}],
                                                 [{"id": req.rid, "completion_tokens": k}]))


@pytest.fixture(scope="module")
def tokenizer(llama_model):
    return get_tokenizer(str(llama_model))


def generate(tokenizer, llama_model, scheduler_info: SchedulerReady, **body: Any):
    sched = EchoLength()
    tm = TokenizerManager(ServerArgs(model_path=str(llama_model)), tokenizer, None, scheduler_info, sched)
    sched.tm = tm

    async def scenario():
        return [out async for out in tm.generate_request(GenerateReqInput(**body))]
    [out] = asyncio.run(asyncio.wait_for(scenario(), 10))
    return out, sched.sent[0]


def test_clamp_by_the_kv_pool_is_reported_in_meta_info_and_finish_reason(tokenizer, llama_model):
    out, sent = generate(tokenizer, llama_model, info(), input_ids=[5] * 200,
                         sampling_params={"max_new_tokens": C - 201})
    assert sent.sampling_params.max_new_tokens == 54  # what admission would clamp to, sent as such
    clamp = out["meta_info"]["max_new_tokens_clamped"]
    assert (clamp["requested"], clamp["used"]) == (C - 201, 54)
    assert "at most 254 tokens (prompt + completion)" in clamp["reason"] and "KV cache pool" in clamp["reason"]
    finish = out["meta_info"]["finish_reason"]
    assert finish["type"] == "length" and finish["length"] == 54
    assert finish["message"].startswith(f"Stopped at max_new_tokens=54, clamped from the requested {C - 201}: ")


def test_accepted_total_one_below_the_context_is_clamped_visibly(tokenizer, llama_model):
    """C binds (T large): L + M = C - 1 passes SGLang's front-door check but admission lets a request
    hold C - 2 tokens; the clamp by one is reported, naming the context length."""
    out, sent = generate(tokenizer, llama_model, info(total=1 << 16), input_ids=[5] * 100,
                         sampling_params={"max_new_tokens": C - 101})
    assert sent.sampling_params.max_new_tokens == C - 102
    assert "context length (512 tokens)" in out["meta_info"]["max_new_tokens_clamped"]["reason"]


def test_default_max_new_tokens_clamp_is_reported_too(tokenizer, llama_model):
    out, sent = generate(tokenizer, llama_model, info(), input_ids=[5] * 200)  # default 128 > 54
    assert sent.sampling_params.max_new_tokens == 54
    assert out["meta_info"]["max_new_tokens_clamped"]["requested"] == 128


def test_unclamped_request_reports_no_clamp(tokenizer, llama_model):
    out, sent = generate(tokenizer, llama_model, info(), input_ids=[5] * 100,
                         sampling_params={"max_new_tokens": MAX_MODEL_LEN - 100})
    assert sent.sampling_params.max_new_tokens == MAX_MODEL_LEN - 100
    assert "max_new_tokens_clamped" not in out["meta_info"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_MODEL_LEN - 100}


# ---------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--context-length", str(C), "--max-total-tokens", str(T)) as handle:
        yield handle


def post(server, n_tokens: int, **sampling: Any):
    return server.post("/generate", json={"input_ids": [5] * n_tokens, "sampling_params": {**GREEDY, **sampling}})


def test_models_card_states_the_limit_admission_applies(server):
    card = server.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN == card["max_req_input_len"]
    assert server.get("/get_server_info").json()["max_req_input_len"] == MAX_MODEL_LEN


def test_prompt_one_below_max_model_len_is_served_and_one_more_is_refused(server):
    ok = post(server, MAX_MODEL_LEN - 1, max_new_tokens=1)
    assert ok.status_code == 200, ok.text
    meta = ok.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 1} and "max_new_tokens_clamped" not in meta
    refused = post(server, MAX_MODEL_LEN, max_new_tokens=1)
    assert refused.status_code == 400
    assert f"exceeds the maximum allowed length ({MAX_MODEL_LEN} tokens)" in refused.json()["error"]["message"]


def test_total_of_max_model_len_runs_as_asked(server):
    resp = post(server, 100, max_new_tokens=MAX_MODEL_LEN - 100)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["completion_tokens"] == MAX_MODEL_LEN - 100 and "max_new_tokens_clamped" not in meta


def test_request_stopped_at_the_kv_pool_ceiling_says_so(server):
    resp = post(server, 200, max_new_tokens=C - 201)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert meta["completion_tokens"] == MAX_REQ_LEN - 1 - 200
    assert meta["max_new_tokens_clamped"]["used"] == MAX_REQ_LEN - 1 - 200
    assert "KV cache pool (256 tokens" in meta["finish_reason"]["message"]


def test_every_endpoint_reports_the_same_max_model_len(server):
    card = server.get("/v1/models").json()["data"][0]["max_model_len"]
    assert server.get("/get_model_info").json()["max_model_len"] == card
    assert server.get("/get_server_info").json()["max_model_len"] == card
