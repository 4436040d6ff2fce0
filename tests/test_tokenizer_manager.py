"""TokenizerManager against a fake scheduler: validation texts at their exact boundaries, request
normalization, streaming delivery, aborts, n > 1, logprob texts; and tokenizer loading errors."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from managers.generate_input import GenerateReqInput, RequestError
from managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from managers.template_manager import TemplateManager
from managers.tokenizer_manager import TokenizerManager
from srt.server_args import ServerArgs
from srt.utils.hf_transformers_utils import get_tokenizer

C = 32  # context length of the fake scheduler
V = 1024  # vocab size of the tiny models


@pytest.fixture(scope="module")
def tokenizer(llama_model):
    return get_tokenizer(str(llama_model))


class FakeScheduler:
    """`send_to_scheduler` stand-in: records messages; with `echo`, answers each generate request on
    the next loop turn by echoing up to `max_new_tokens` prompt ids (one update per token when
    streaming, all in one burst before the consumer wakes up)."""

    def __init__(self, echo: bool = True, max_echo: int = 4):
        self.sent: List[Any] = []
        self.echo = echo
        self.max_echo = max_echo
        self.tm: Optional[TokenizerManager] = None

    def __call__(self, msg: Any) -> None:
        self.sent.append(msg)
        if self.echo and isinstance(msg, TokenizedGenerateReqInput):
            asyncio.get_running_loop().call_soon(self.answer, msg)

    @property
    def requests(self) -> List[TokenizedGenerateReqInput]:
        return [m for m in self.sent if isinstance(m, TokenizedGenerateReqInput)]

    def answer(self, req: TokenizedGenerateReqInput) -> None:
        n = req.sampling_params.n
        k = min(req.sampling_params.max_new_tokens, self.max_echo)
        for i in range(n):
            rid = req.rid if n == 1 else f"{req.rid}-{i}"
            extra = {} if n == 1 else {"parent_rid": req.rid, "index": i}
            steps = range(1, k + 1) if req.stream else [k]
            for step in steps:
                ids = [t + i for t in req.input_ids[:step]]
                finish = {"type": "length", "length": k} if step == k else None
                self.tm.handle_batch_str_out(update(rid, ids, finish, prompt_tokens=len(req.input_ids), **extra))


def update(rid: str, ids: List[int], finish: Optional[Dict[str, Any]] = None, text: Optional[str] = None,
           **meta: Any) -> BatchStrOut:
    meta_info = {"id": rid, "prompt_tokens": 3, "completion_tokens": len(ids), "cached_tokens": 0,
                 "total_retractions": 0, **meta}
    return BatchStrOut([rid], [text if text is not None else " ".join(map(str, ids))], [ids], [finish], [meta_info])


def make_tm(tokenizer, model_path: Path, scheduler: Optional[FakeScheduler] = None, context_len: int = C,
            **server_kwargs: Any) -> TokenizerManager:
    args = ServerArgs(model_path=str(model_path), **server_kwargs)
    info = SchedulerReady(ok=True, max_total_num_tokens=4096, max_req_input_len=context_len - 6,
                          max_req_len=context_len - 1, max_running_requests=8, context_len=context_len,
                          vocab_size=V)
    scheduler = scheduler if scheduler is not None else FakeScheduler()
    tm = TokenizerManager(args, tokenizer, TemplateManager.load(tokenizer, None, str(model_path)), info, scheduler)
    scheduler.tm = tm
    return tm


async def collect(tm: TokenizerManager, **body: Any) -> List[Any]:
    return [out async for out in tm.generate_request(GenerateReqInput(**body))]


def run(coro, timeout: float = 10.0):
    """Run a scenario; a lost update shows up as a TimeoutError instead of a hung test."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def refused(tm: TokenizerManager, **body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        run(collect(tm, **body))
    assert info.value.status_code == 400
    assert not tm.send.requests, "nothing may reach the scheduler for a refused request"
    return info.value


# ---------------------------------------------------------------- context-length checks
def test_input_one_token_below_context_length_is_accepted(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    [out] = run(collect(tm, input_ids=[7] * (C - 1)))
    assert len(tm.send.requests[0].input_ids) == C - 1
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_input_at_context_length_is_refused_with_sglang_text(tokenizer, llama_model):
    err = refused(make_tm(tokenizer, llama_model), input_ids=[7] * C)
    assert str(err).startswith(f"The input ({C} tokens) is longer than the model's context length ({C} tokens).")
    assert "--allow-auto-truncate" in str(err)
    assert err.code == "context_length_exceeded"


def test_text_input_is_measured_in_tokens(tokenizer, llama_model):
    text = "hello world " * 40
    L = len(tokenizer.encode(text))
    assert L >= C
    err = refused(make_tm(tokenizer, llama_model), text=text)
    assert f"The input ({L} tokens)" in str(err)


def test_auto_truncate_keeps_first_tokens_and_reports_it(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, allow_auto_truncate=True)
    [out] = run(collect(tm, input_ids=list(range(C + 8))))
    assert tm.send.requests[0].input_ids == list(range(C - 1))
    assert out["meta_info"]["truncated"] is True
    assert out["meta_info"]["truncated_input_tokens"] == C + 8


def test_explicit_max_new_tokens_up_to_one_below_context_is_accepted_and_its_clamp_reported(tokenizer, llama_model):
    """Admission lets a request hold max_req_len - 1 = C - 2 tokens: the front door clamps to that
    (instead of the scheduler doing it silently) and says so (tests/test_limits_agree.py)."""
    tm = make_tm(tokenizer, llama_model)
    [out] = run(collect(tm, input_ids=[7] * 20, sampling_params={"max_new_tokens": C - 1 - 20}))
    assert tm.send.requests[0].sampling_params.max_new_tokens == C - 2 - 20
    assert out["meta_info"]["max_new_tokens_clamped"]["used"] == C - 2 - 20


def test_explicit_max_new_tokens_reaching_context_is_refused_with_sglang_text(tokenizer, llama_model):
    err = refused(make_tm(tokenizer, llama_model), input_ids=[7] * 20, sampling_params={"max_new_tokens": C - 20})
    assert str(err) == (
        f"Requested token count exceeds the model's maximum context length of {C} tokens. You requested a "
        f"total of {C} tokens: 20 tokens from the input messages and {C - 20} tokens for the completion. "
        f"Please reduce the number of tokens in the input messages or the completion to fit within the limit.")
    assert err.code == "context_length_exceeded"


def test_default_max_new_tokens_is_not_checked_against_context(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    run(collect(tm, input_ids=[7] * (C - 1)))  # default max_new_tokens=128 would exceed C
    run(collect(tm, input_ids=[7] * (C - 1), sampling_params={"max_new_tokens": None}))
    assert [r.sampling_params.max_new_tokens for r in tm.send.requests] == [128, 128]


def test_auto_truncate_clamps_explicit_max_new_tokens(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, allow_auto_truncate=True)
    [out] = run(collect(tm, input_ids=[7] * 20, sampling_params={"max_new_tokens": 50, "min_new_tokens": 40}))
    sp = tm.send.requests[0].sampling_params
    assert (sp.max_new_tokens, sp.min_new_tokens) == (C - 20 - 2, C - 20 - 2)  # admission's max_req_len - 1 - L
    clamp = out["meta_info"]["max_new_tokens_clamped"]
    assert (clamp["requested"], clamp["used"]) == (50, C - 20 - 2)


# ---------------------------------------------------------------- other request validation
@pytest.mark.parametrize("params, words", [
    ({"temperature": -1}, ["temperature", "-1"]),
    ({"top_p": 1.5}, ["top_p", "(0, 1]", "1.5"]),
    ({"foo": 1}, ["Unknown sampling parameter 'foo'"]),
    ({"stop_token_ids": [V]}, ["stop_token_ids", str(V)]),
])
def test_bad_sampling_params_are_refused_naming_the_parameter(tokenizer, llama_model, params, words):
    err = refused(make_tm(tokenizer, llama_model), text="hi", sampling_params=params)
    for word in words:
        assert word in str(err)


def test_input_ids_outside_vocabulary_are_refused(tokenizer, llama_model):
    err = refused(make_tm(tokenizer, llama_model), input_ids=[1, V, 2])
    assert f"token id {V} at position 1" in str(err) and f"[0, {V})" in str(err)
    err = refused(make_tm(tokenizer, llama_model), input_ids=[-1])
    assert "token id -1" in str(err)


def test_duplicate_in_flight_rid_is_refused(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        first = tm.generate_request(GenerateReqInput(text="hi", rid="r1"))
        waiting = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(RequestError, match="Duplicate request id 'r1'"):
            await collect(tm, text="hi", rid="r1")
        tm.handle_batch_str_out(update("r1", [5], {"type": "length", "length": 1}))
        assert (await waiting)["output_ids"] == [5]
        await first.aclose()
    run(scenario())


def test_one_bad_item_refuses_the_whole_batch_before_sending(tokenizer, llama_model):
    err = refused(make_tm(tokenizer, llama_model), input_ids=[[1, 2], [7] * C])
    assert "longer than the model's context length" in str(err)


# ---------------------------------------------------------------- normalization
@pytest.mark.parametrize("body, match", [
    ({"text": "a", "input_ids": [1]}, "exactly one of 'text' or 'input_ids', not both"),
    ({}, "exactly one of 'text' or 'input_ids'"),
    ({"text": ""}, "text is empty"),
    ({"text": []}, "text is an empty list"),
    ({"text": ["a", ""]}, r"text\[1\] is empty"),
    ({"text": 5}, "text must be a string or a list of strings"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [[1], []]}, r"input_ids\[1\] is empty"),
    ({"input_ids": [1, "2"]}, "list of integer token ids"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params has 1 entries but the batch has 2"),
    ({"text": "a", "sampling_params": [{}]}, "sampling_params must be an object for a single prompt"),
    ({"text": ["a", "b"], "rid": "x"}, "rid must be a list of 2 strings"),
    ({"text": ["a", "b"], "rid": ["x", "x"]}, "must be distinct"),
    ({"text": "a", "rid": 3}, "rid must be a non-empty string"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob has 1 entries"),
    ({"text": "a", "logprob_start_len": -2}, "logprob_start_len must be -1"),
    ({"text": "a", "stream": "yes"}, "stream must be a boolean"),
])
def test_normalize_refuses_bad_shapes(body, match):
    with pytest.raises(RequestError, match=match):
        GenerateReqInput(**body).normalize()


def test_normalize_accepts_nulls_and_empty_lists():
    [item] = GenerateReqInput(text="a", sampling_params=None, rid=None, return_logprob=None,
                              logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=[]).normalize()
    assert item.sampling_params == {} and len(item.rid) == 32
    assert (item.return_logprob, item.logprob_start_len, item.top_logprobs_num, item.token_ids_logprob) == (
        False, -1, 0, None)


def test_normalize_expands_a_batch_per_item():
    items = GenerateReqInput(input_ids=[[1], [2, 3]], sampling_params={"temperature": 0},
                             rid=["a", None], return_logprob=[True, False], cache_salt="s").normalize()
    assert [i.input_ids for i in items] == [[1], [2, 3]]
    assert items[0].rid == "a" and len(items[1].rid) == 32
    assert [i.return_logprob for i in items] == [True, False]
    assert items[0].sampling_params == items[1].sampling_params == {"temperature": 0}
    assert items[0].sampling_params is not items[1].sampling_params
    assert items[0].extra_key == "s"


def test_from_dict_refuses_unknown_fields_and_set_unsupported_ones():
    with pytest.raises(RequestError, match="Unknown field 'temprature'"):
        GenerateReqInput.from_dict({"text": "a", "temprature": 0})
    with pytest.raises(RequestError, match="'image_data' is not supported"):
        GenerateReqInput.from_dict({"text": "a", "image_data": "x.png"})
    assert GenerateReqInput.from_dict({"text": "a", "image_data": None, "lora_path": None}).text == "a"


# ---------------------------------------------------------------- responses and streaming
def test_non_stream_yields_one_final_dict_with_meta(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    outs = run(collect(tm, input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}))
    assert len(outs) == 1
    meta = outs[0]["meta_info"]
    assert outs[0]["output_ids"] == [5, 6]
    assert meta["id"] == tm.send.requests[0].rid and meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["e2e_latency"] >= 0 and meta["prompt_tokens"] == 3
    assert tm.rid_to_state == {}


def test_stream_delivers_every_update_once_in_order_despite_bursts(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        gen = tm.generate_request(GenerateReqInput(input_ids=[1, 2, 3], stream=True, rid="s"))
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        for k in (1, 2, 3):  # a burst: three updates before the consumer runs
            tm.handle_batch_str_out(update("s", list(range(10, 10 + k))))
        got = [(await first)["output_ids"]]
        got += [(await gen.__anext__())["output_ids"] for _ in range(2)]
        two = BatchStrOut(["s", "s"], ["a", "b"], [[10, 11, 12, 13], [10, 11, 12, 13, 14]],
                          [None, {"type": "length", "length": 5}], [{"id": "s"}, {"id": "s"}])
        tm.handle_batch_str_out(two)  # two updates of one rid in one message
        got += [out["output_ids"] async for out in gen]
        return got
    got = run(scenario())
    assert got == [list(range(10, 10 + k)) for k in range(1, 6)]


def test_stream_with_echo_scheduler_ends_with_finished_update(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    outs = run(collect(tm, input_ids=[5, 6, 7, 8], stream=True))
    assert [o["output_ids"] for o in outs] == [[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]]
    assert [o["meta_info"]["finish_reason"] is not None for o in outs] == [False, False, False, True]
    m = tm.metrics
    assert (m.num_requests, m.num_finished, m.generation_tokens, m.prompt_tokens) == (1, 1, 4, 4)
    assert m.time_to_first_token.count == 1 and m.inter_token_latency.count == 3 and m.e2e_latency.count == 1


def test_closing_a_stream_early_aborts_the_request(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        gen = tm.generate_request(GenerateReqInput(text="hello", stream=True, rid="gone"))
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        tm.handle_batch_str_out(update("gone", [1]))
        await pending
        await gen.aclose()  # the client disconnected
        tm.handle_batch_str_out(update("gone", [1, 2]))  # late update: ignored
        return tm
    tm = run(scenario())
    aborts = [m for m in tm.send.sent if isinstance(m, AbortReq)]
    assert [a.rid for a in aborts] == ["gone"] and "gone" not in tm.rid_to_state
    assert tm.metrics.num_aborted == 1


def test_breaking_out_of_a_stream_aborts_the_request(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))

        async def consumer():
            async for _ in tm.generate_request(GenerateReqInput(text="hi", stream=True, rid="b")):
                break  # the generator is finalized without an explicit aclose()

        task = asyncio.ensure_future(consumer())
        await asyncio.sleep(0)
        tm.handle_batch_str_out(update("b", [1]))
        await task
        for _ in range(3):  # let asyncio's async-generator finalizer run
            await asyncio.sleep(0)
        return tm
    tm = run(scenario())
    assert [m.rid for m in tm.send.sent if isinstance(m, AbortReq)] == ["b"] and tm.rid_to_state == {}

def test_cancelling_a_waiting_request_aborts_it(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, text="hello", rid="c", sampling_params={"n": 2}))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return tm
    tm = run(scenario())
    assert [m.rid for m in tm.send.sent if isinstance(m, AbortReq)] == ["c"]  # prefix covers c-0, c-1


def test_finished_request_sends_no_abort(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    run(collect(tm, text="hello", stream=True))
    assert not [m for m in tm.send.sent if isinstance(m, AbortReq)]


def test_scheduler_refusal_becomes_request_error(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, text="hello", rid="big"))
        await asyncio.sleep(0)
        message = "Input length (30 tokens) exceeds the maximum allowed length (26 tokens). Use a shorter input."
        tm.handle_batch_str_out(update("big", [], {"type": "abort", "message": message, "status_code": 400}))
        with pytest.raises(RequestError) as info:
            await task
        return info.value
    err = run(scenario())
    assert err.status_code == 400 and err.code == "context_length_exceeded" and "maximum allowed length" in str(err)


def test_client_abort_finish_is_delivered_not_raised(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, text="hello", rid="a"))
        await asyncio.sleep(0)
        await tm.abort_request("a")
        finish = {"type": "abort", "message": "Aborted by request.", "status_code": 499}
        tm.handle_batch_str_out(update("a", [3], finish))
        return tm, await task
    tm, [out] = run(scenario())
    assert isinstance(tm.send.sent[-1], AbortReq) and tm.send.sent[-1].rid == "a"
    assert out["meta_info"]["finish_reason"]["status_code"] == 499 and tm.metrics.num_aborted == 1



def test_fail_all_fails_in_flight_requests_and_admin_calls_with_503(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        gen_task = asyncio.ensure_future(collect(tm, text="hi", sampling_params={"n": 2}))
        flush_task = asyncio.ensure_future(tm.flush_cache())
        await asyncio.sleep(0)
        tm.fail_all("Scheduler process died: boom")
        errors = []
        for task in (gen_task, flush_task):
            with pytest.raises(RequestError, match="boom") as info:
                await task
            errors.append(info.value.status_code)
        return tm, errors
    tm, errors = run(scenario())
    assert errors == [503, 503] and tm.rid_to_state == {}
    assert not [m for m in tm.send.sent if isinstance(m, AbortReq)]

# ---------------------------------------------------------------- batches and n > 1
def test_batch_non_stream_yields_ordered_list(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    [outs] = run(collect(tm, input_ids=[[1, 2], [3, 4]], sampling_params=[{"max_new_tokens": 1}, {}]))
    assert [o["output_ids"] for o in outs] == [[1], [3, 4]]
    # The default 128 is clamped to what a 2-token prompt may generate here: max_req_len - 1 - 2.
    assert [r.sampling_params.max_new_tokens for r in tm.send.requests] == [1, C - 2 - 2]


def test_batch_stream_updates_carry_index(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    outs = run(collect(tm, input_ids=[[1, 2], [3, 4]], stream=True, sampling_params={"max_new_tokens": 2}))
    by_index = {0: [], 1: []}
    for out in outs:
        by_index[out["index"]].append(out["output_ids"])
    assert by_index == {0: [[1], [1, 2]], 1: [[3], [3, 4]]}


def test_n_greater_than_one_sends_one_request_and_collects_children(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, input_ids=[1, 2], rid="p", sampling_params={"n": 3}))
        await asyncio.sleep(0)
        for i in (2, 0, 1):  # children finish out of order
            tm.handle_batch_str_out(update(f"p-{i}", [100 + i], {"type": "length", "length": 1},
                                           parent_rid="p", index=i))
        return tm, await task
    tm, [outs] = run(scenario())
    [req] = tm.send.requests
    assert req.rid == "p" and req.sampling_params.n == 3
    assert [o["output_ids"] for o in outs] == [[100], [101], [102]]
    assert [o["meta_info"]["id"] for o in outs] == ["p-0", "p-1", "p-2"]
    assert tm.rid_to_state == {} and not [m for m in tm.send.sent if isinstance(m, AbortReq)]


def test_n_greater_than_one_stream_and_batch_use_flat_indices(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    outs = run(collect(tm, input_ids=[[1], [2]], stream=True, sampling_params={"n": 2, "max_new_tokens": 1}))
    assert sorted((o["index"], o["output_ids"][0]) for o in outs) == [(0, 1), (1, 2), (2, 2), (3, 3)]


def test_refusal_of_n_request_under_parent_rid_fails_it(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, text="hi", rid="q", sampling_params={"n": 2}))
        await asyncio.sleep(0)
        tm.handle_batch_str_out(update("q", [], {"type": "abort", "message": "The request queue is full.",
                                                 "status_code": 503}))
        with pytest.raises(RequestError, match="queue is full") as info:
            await task
        return tm, info.value
    tm, err = run(scenario())
    assert err.status_code == 503 and tm.rid_to_state == {}


# ---------------------------------------------------------------- logprobs
def _logprob_meta() -> Dict[str, Any]:
    return {"output_token_logprobs": [[-0.5, 264], [-1.0, 79]],
            "output_top_logprobs": [[[-0.5, 264], [-2.0, 79]], [[-1.0, 79]]],
            "input_token_logprobs": [[None, 264], [-3.0, 79]]}


def _logprob_run(tokenizer, llama_model, with_text: bool) -> Dict[str, Any]:
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        task = asyncio.ensure_future(collect(tm, text="hi", rid="l", return_logprob=True, top_logprobs_num=2,
                                             logprob_start_len=0, return_text_in_logprobs=with_text))
        await asyncio.sleep(0)
        tm.handle_batch_str_out(update("l", [264, 79], {"type": "length", "length": 2}, **_logprob_meta()))
        return (await task)[0]["meta_info"]
    return run(scenario())


def test_return_text_in_logprobs_adds_decoded_token_text(tokenizer, llama_model):
    meta = _logprob_run(tokenizer, llama_model, with_text=True)
    a, b = tokenizer.decode([264]), tokenizer.decode([79])
    assert meta["output_token_logprobs"] == [[-0.5, 264, a], [-1.0, 79, b]]
    assert meta["output_top_logprobs"] == [[[-0.5, 264, a], [-2.0, 79, b]], [[-1.0, 79, b]]]
    assert meta["input_token_logprobs"] == [[None, 264, a], [-3.0, 79, b]]


def test_logprob_entries_have_null_text_without_the_flag(tokenizer, llama_model):
    meta = _logprob_run(tokenizer, llama_model, with_text=False)
    assert meta["output_token_logprobs"] == [[-0.5, 264, None], [-1.0, 79, None]]


def test_logprob_options_reach_the_scheduler(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    run(collect(tm, text="hi", return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                token_ids_logprob=[1, 2], extra_key="k", cache_salt="s"))
    req = tm.send.requests[0]
    assert (req.return_logprob, req.logprob_start_len, req.top_logprobs_num, req.token_ids_logprob) == (
        True, 0, 3, [1, 2])
    assert req.extra_key == ("k", "s") and req.input_text == "hi"


# ---------------------------------------------------------------- tokenization, replies, chat
def test_text_is_tokenized_with_special_tokens_like_sglang(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    run(collect(tm, text="hello world"))
    assert tm.send.requests[0].input_ids == tokenizer.encode("hello world", add_special_tokens=True)
    assert tm.prompts.executor is None


def test_long_text_is_tokenized_off_the_event_loop(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, context_len=4096, tokenizer_worker_threshold=16)
    text = "hello world, " * 20
    run(collect(tm, text=text))
    assert tm.prompts.executor is not None and tm.prompts.worker_tokenizer is not None
    assert tm.send.requests[0].input_ids == tokenizer.encode(text)
    tm.close()


def test_flush_cache_and_get_load_await_their_replies(tokenizer, llama_model):
    async def scenario():
        tm = make_tm(tokenizer, llama_model, scheduler=FakeScheduler(echo=False))
        flush = asyncio.ensure_future(tm.flush_cache())
        load = asyncio.ensure_future(tm.get_load())
        await asyncio.sleep(0)
        tm.handle_reply(GetLoadReqOutput(1, 2, 0.5, 100))
        tm.handle_reply(FlushCacheReqOutput(False, "Cache not flushed: 1 running"))
        return tm, await flush, await load
    tm, flushed, load = run(scenario())
    assert [type(m) for m in tm.send.sent] == [FlushCacheReqInput, GetLoadReqInput]
    assert flushed.success is False and "not flushed" in flushed.message
    assert (load.num_running_reqs, load.num_waiting_reqs) == (1, 2)


def test_chat_to_prompt_uses_the_template(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    prompt = tm.chat_to_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- tokenizer loading
def _copy_tokenizer(src: Path, dst: Path, **config_changes: Any) -> Path:
    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(src / name, dst / name)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def test_unknown_tokenizer_class_names_trust_remote_code(llama_model, tmp_path):
    path = _copy_tokenizer(llama_model, tmp_path / "tok", tokenizer_class="NoSuchTokenizerFast")
    with pytest.raises(RuntimeError) as info:
        get_tokenizer(str(path))
    text = str(info.value)
    assert text.startswith(
        "Failed to load the tokenizer. If the tokenizer is a custom tokenizer not yet available in the "
        "HuggingFace transformers library, consider setting trust_remote_code=True")
    assert "--trust-remote-code" in text and "NoSuchTokenizerFast" in text


def test_custom_code_tokenizer_without_trust_is_refused(llama_model, tmp_path):
    path = _copy_tokenizer(llama_model, tmp_path / "tok", tokenizer_class="MyTokenizer",
                           auto_map={"AutoTokenizer": ["tokenization_my.MyTokenizer", None]})
    with pytest.raises(RuntimeError, match="--trust-remote-code") as info:
        get_tokenizer(str(path))
    assert "auto_map" in str(info.value)


def test_missing_tokenizer_path_says_it_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        get_tokenizer(str(tmp_path / "nowhere"))
    assert "does not exist" in str(info.value) and "Repo id" not in str(info.value)


def test_directory_without_tokenizer_files_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        get_tokenizer(str(tmp_path))


def test_qwen2_tokenizer_loads(qwen2_model):
    tok = get_tokenizer(str(qwen2_model))
    assert tok.encode("hello world") and tok.chat_template

