"""Front-door bounds of one request (issue 15, items 1, 2 and 5): batch size and `n` are capped by
--max-batch-items and --max-n, an over-long prompt is refused after tokenizing only a prefix of
it, big batches are tokenized without stalling the event loop, and a rid is unique while anything
of its request is in flight (n > 1 children included, an aborted request until its finish came back).

The tokenizer-manager tests use a fake scheduler; the HTTP tests one real server on the tiny llama.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, List

import pytest
import requests

from managers.generate_input import GenerateReqInput, RequestError
from managers.io_struct import AbortReq, BatchStrOut, SchedulerReady, TokenizedGenerateReqInput
from managers.tokenizer_manager import TokenizerManager
from server_utils import running_server
from srt.server_args import ServerArgs
from srt.utils.hf_transformers_utils import get_tokenizer

V = 1024  # vocab size of the tiny models
LENGTH_1 = {"type": "length", "length": 1}


@pytest.fixture(scope="module")
def tokenizer(llama_model):
    return get_tokenizer(str(llama_model))


class Recorder:
    """`send_to_scheduler` stand-in: records messages, answers nothing by itself."""

    def __init__(self) -> None:
        self.sent: List[Any] = []

    def __call__(self, msg: Any) -> None:
        self.sent.append(msg)

    @property
    def requests(self) -> List[TokenizedGenerateReqInput]:
        return [m for m in self.sent if isinstance(m, TokenizedGenerateReqInput)]

    @property
    def aborts(self) -> List[str]:
        return [m.rid for m in self.sent if isinstance(m, AbortReq)]


def make_tm(tokenizer, model_path: Path, context_len: int = 32, **server_kwargs: Any) -> TokenizerManager:
    args = ServerArgs(model_path=str(model_path), **server_kwargs)
    info = SchedulerReady(ok=True, max_total_num_tokens=1 << 20, max_req_input_len=context_len - 6,
                          max_req_len=context_len - 1, max_running_requests=8, context_len=context_len,
                          vocab_size=V)
    return TokenizerManager(args, tokenizer, None, info, Recorder())


def finish(rid: str, **meta: Any) -> BatchStrOut:
    return BatchStrOut([rid], ["x"], [[5]], [LENGTH_1], [{"id": rid, "completion_tokens": 1, **meta}])


def run(coro, timeout: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(tm: TokenizerManager, **body: Any) -> List[Any]:
    return [out async for out in tm.generate_request(GenerateReqInput(**body))]


def refusal(tm: TokenizerManager, **body: Any) -> RequestError:
    with pytest.raises(RequestError) as info:
        run(collect(tm, **body))
    assert info.value.status_code == 400
    assert not tm.send.requests, "a refused request must never reach the scheduler"
    return info.value


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


# ---------------------------------------------------------------- item 1: batch size and n
def test_batch_over_max_batch_items_is_refused_naming_the_flag(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, max_batch_items=4)
    err = refusal(tm, text=["a"] * 5)
    assert "5 prompts" in err.message and "--max-batch-items=4" in err.message
    assert err.param == "text"


def test_batch_at_max_batch_items_is_sent(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, max_batch_items=4)

    async def scenario():
        task = asyncio.ensure_future(collect(tm, input_ids=[[1]] * 4))
        await asyncio.sleep(0.05)
        for req in tm.send.requests:
            tm.handle_batch_str_out(finish(req.rid))
        return await task
    [outs] = run(scenario())
    assert len(outs) == 4 and len(tm.send.requests) == 4


def test_twenty_thousand_item_batch_is_refused_fast_with_defaults(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    start = time.perf_counter()
    err = refusal(tm, text=["a"] * 20000, sampling_params={"max_new_tokens": 1})
    assert time.perf_counter() - start < 2.0
    assert "20000 prompts" in err.message and "--max-batch-items=512" in err.message


def test_n_over_max_n_is_refused_naming_the_flag(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    start = time.perf_counter()
    err = refusal(tm, text="hi", sampling_params={"n": 1_000_000})
    assert time.perf_counter() - start < 2.0
    assert "n=1000000" in err.message and "--max-n=128" in err.message and err.param == "n"


def test_outputs_of_a_batch_times_n_are_bounded_too(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, max_batch_items=10, max_n=8)
    err = refusal(tm, input_ids=[[1], [2]], sampling_params=[{"n": 8}, {"n": 3}])
    assert "11 outputs" in err.message and "--max-batch-items=10" in err.message


def test_bounds_flags_are_checked_at_start_up(llama_model):
    for flag in ("max_batch_items", "max_n"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be >= 1, got 0"):
            ServerArgs(model_path=str(llama_model), **{flag: 0})


def test_big_batch_is_tokenized_without_stalling_the_event_loop(tokenizer, llama_model):
    """Every text is under the off-loop threshold, but the batch as a whole is not: it must not be
    tokenized in one stretch on the loop (other requests' updates would wait behind it)."""
    tm = make_tm(tokenizer, llama_model, context_len=1 << 16, tokenizer_worker_threshold=4096)
    texts = ["hello world, this is a test. " * 130] * 64  # 64 texts of ~3.8k characters

    async def scenario():
        gaps, last = [], time.perf_counter()
        done = asyncio.Event()

        async def ticker():
            nonlocal last
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        gen = tm.generate_request(GenerateReqInput(text=texts, sampling_params={"max_new_tokens": 1}))
        first = asyncio.ensure_future(gen.__anext__())
        while len(tm.send.requests) < len(texts):
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - start
        done.set()
        await tick
        for req in tm.send.requests:
            tm.handle_batch_str_out(finish(req.rid))
        await first
        await gen.aclose()
        return max(gaps), elapsed
    worst_gap, elapsed = run(scenario())
    tm.close()
    assert tm.send.requests[0].input_ids == tokenizer.encode(texts[0])
    assert worst_gap < max(0.5 * elapsed, 0.1), (worst_gap, elapsed)


# ---------------------------------------------------------------- item 2: over-long prompts
def test_ten_megabyte_prompt_is_refused_fast_with_the_context_length_error(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model, context_len=2048)
    text = "hello world, this is a test. " * 360_000  # 10.4 MB
    before = rss_mib()
    start = time.perf_counter()
    err = refusal(tm, text=text)
    elapsed = time.perf_counter() - start
    grown = rss_mib() - before
    tm.close()
    assert elapsed < 5.0, elapsed
    assert grown < 150, f"RSS grew {grown:.0f} MiB"
    assert err.message.startswith("The input (at least ")
    assert "tokens) is longer than the model's context length (2048 tokens)." in err.message
    assert "--allow-auto-truncate" in err.message and err.code == "context_length_exceeded"


def test_long_prompt_within_the_context_is_tokenized_exactly(tokenizer, llama_model):
    """More UTF-8 bytes than the context length (so the early check runs) but fewer tokens."""
    C = 4096
    text = "hello world, this is a test. " * 200  # 5800 bytes, 2800 tokens
    tm = make_tm(tokenizer, llama_model, context_len=C)

    async def scenario():
        task = asyncio.ensure_future(collect(tm, text=text, rid="long"))
        await asyncio.sleep(0.5)
        tm.handle_batch_str_out(finish("long"))
        return await task
    run(scenario())
    tm.close()
    ids = tokenizer.encode(text)
    assert len(text.encode()) >= C > len(ids)
    assert tm.send.requests[0].input_ids == ids


def test_prompt_just_over_the_context_reports_its_exact_length(tokenizer, llama_model):
    text = "hello world " * 40
    L = len(tokenizer.encode(text))
    err = refusal(make_tm(tokenizer, llama_model, context_len=L - 3), text=text)
    assert err.message.startswith(f"The input ({L} tokens) is longer than the model's context length ({L - 3} tokens).")


def test_auto_truncate_of_a_huge_prompt_keeps_its_first_tokens_fast(tokenizer, llama_model):
    C = 2048
    text = "hello world, this is a test. " * 360_000
    tm = make_tm(tokenizer, llama_model, context_len=C, allow_auto_truncate=True)

    async def scenario():
        task = asyncio.ensure_future(collect(tm, text=text, rid="t"))
        while not tm.send.requests:
            await asyncio.sleep(0.01)
        tm.handle_batch_str_out(finish("t"))
        return await task
    start = time.perf_counter()
    [out] = run(scenario())
    assert time.perf_counter() - start < 5.0
    tm.close()
    assert tm.send.requests[0].input_ids == tokenizer.encode(text[:20_000])[: C - 1]
    assert out["meta_info"]["truncated"] is True and out["meta_info"]["truncated_input_tokens"] >= C


def test_over_long_input_ids_are_refused_before_their_ids_are_walked(tokenizer, llama_model):
    """The length is known without looking at the ids: a 3M-id prompt is refused on its length
    (even with a bad entry at its end, which only a walk over the ids would find)."""
    err = refusal(make_tm(tokenizer, llama_model, context_len=2048), input_ids=[5] * 3_000_000 + ["x"])
    assert err.message.startswith("The input (3000001 tokens) is longer than the model's context length (2048 tokens).")


# ---------------------------------------------------------------- item 5: rids
def child_update(parent: str, index: int, ids: List[int]) -> BatchStrOut:
    """An n > 1 child's finish: its rid is only a label, `parent_rid` and `index` say whose it is."""
    rid = f"{parent}-{index}"
    return BatchStrOut([rid], ["x"], [ids], [LENGTH_1], [{"id": rid, "parent_rid": parent, "index": index}])


def test_user_rid_equal_to_a_child_label_never_receives_that_childs_output(tokenizer, llama_model):
    """Children live in their parent's namespace: a user request `abc-0` and child 0 of an n > 1
    request `abc` run side by side and each gets its own output."""
    tm = make_tm(tokenizer, llama_model)

    async def scenario():
        parent = asyncio.ensure_future(collect(tm, input_ids=[1, 2], rid="abc", sampling_params={"n": 2}))
        user = asyncio.ensure_future(collect(tm, input_ids=[3], rid="abc-0"))
        await asyncio.sleep(0.01)
        tm.handle_batch_str_out(child_update("abc", 0, [10]))
        tm.handle_batch_str_out(child_update("abc", 1, [11]))
        tm.handle_batch_str_out(BatchStrOut(["abc-0"], ["y"], [[30]], [LENGTH_1], [{"id": "abc-0"}]))
        return await parent, await user
    ([children], [mine]) = run(scenario(), timeout=10)
    assert [c["output_ids"] for c in children] == [[10], [11]]
    assert mine["output_ids"] == [30] and mine["meta_info"]["id"] == "abc-0"
    assert [r.rid for r in tm.send.requests] == ["abc", "abc-0"]


def test_batch_with_a_rid_equal_to_a_sibling_childs_label_is_served(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)

    async def scenario():
        task = asyncio.ensure_future(collect(tm, input_ids=[[1], [2]], rid=["abc", "abc-0"], sampling_params={"n": 2}))
        await asyncio.sleep(0.01)
        for parent in ("abc", "abc-0"):
            for i in range(2):
                tm.handle_batch_str_out(child_update(parent, i, [len(parent) * 10 + i]))
        return await task
    [outs] = run(scenario(), timeout=10)
    assert [o["output_ids"] for o in outs] == [[30], [31], [50], [51]]


def test_rid_of_an_aborted_request_is_refused_until_its_finish_arrives(tokenizer, llama_model):
    """A client disconnects; until the scheduler's abort finish for that rid came back, a new
    request with the same rid would receive it, so it is refused; afterwards it is served."""
    tm = make_tm(tokenizer, llama_model)

    async def scenario():
        first = asyncio.ensure_future(collect(tm, input_ids=[1], rid="r"))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        assert tm.send.aborts == ["r"]
        with pytest.raises(RequestError, match="'r'") as info:
            await collect(tm, input_ids=[1], rid="r")
        assert info.value.status_code == 400
        tm.handle_batch_str_out(BatchStrOut(["r"], [""], [[]], [{"type": "abort", "message": "Aborted by request.",
                                                                  "status_code": 499}], [{"id": "r"}]))
        second = asyncio.ensure_future(collect(tm, input_ids=[2], rid="r"))
        await asyncio.sleep(0.01)
        tm.handle_batch_str_out(finish("r"))
        return await second
    [out] = run(scenario(), timeout=10)
    assert out["meta_info"]["finish_reason"] == LENGTH_1
    assert [r.input_ids for r in tm.send.requests] == [[1], [2]]


def test_rid_of_an_aborted_n_request_is_free_once_every_child_finished(tokenizer, llama_model):
    tm = make_tm(tokenizer, llama_model)
    aborted = {"type": "abort", "message": "Aborted by request.", "status_code": 499}

    async def scenario():
        first = asyncio.ensure_future(collect(tm, input_ids=[1], rid="p", sampling_params={"n": 2}))
        await asyncio.sleep(0.01)
        first.cancel()
        await asyncio.sleep(0.01)
        tm.handle_batch_str_out(BatchStrOut(["p-0"], [""], [[]], [aborted], [{"parent_rid": "p", "index": 0}]))
        with pytest.raises(RequestError, match="'p'"):
            await collect(tm, input_ids=[1], rid="p")
        tm.handle_batch_str_out(BatchStrOut(["p-1"], [""], [[]], [aborted], [{"parent_rid": "p", "index": 1}]))
        second = asyncio.ensure_future(collect(tm, input_ids=[2], rid="p"))
        await asyncio.sleep(0.01)
        tm.handle_batch_str_out(finish("p"))
        return await second
    [out] = run(scenario(), timeout=10)
    assert out["meta_info"]["finish_reason"] == LENGTH_1


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(llama_model):
    with running_server(llama_model, "--max-request-body-mb", "16") as handle:
        yield handle


def front_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_http_twenty_thousand_item_batch_is_a_fast_400(server):
    sent_before = server.get("/get_server_info").json()["load"]["counters"]["num_requests"]
    start = time.perf_counter()
    resp = server.post("/generate", json={"text": ["a"] * 20000, "sampling_params": {"max_new_tokens": 1}})
    assert time.perf_counter() - start < 5.0
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "20000 prompts" in error["message"] and "--max-batch-items=512" in error["message"]
    load = server.get("/get_server_info").json()["load"]
    assert load["num_waiting_reqs"] == 0 and load["counters"]["num_requests"] == sent_before
    small = server.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert small.status_code == 200


def test_http_n_of_a_million_is_a_fast_400(server):
    start = time.perf_counter()
    resp = server.post("/generate", json={"text": "hi", "sampling_params": {"n": 1_000_000}})
    assert time.perf_counter() - start < 5.0
    assert resp.status_code == 400 and "--max-n=128" in resp.json()["error"]["message"]
    chat = server.post("/v1/completions", json={"prompt": "hi", "n": 129, "max_tokens": 1})
    assert chat.status_code == 400 and "--max-n=128" in chat.json()["error"]["message"]


def test_http_ten_megabyte_prompt_is_refused_in_seconds_without_an_rss_jump(server):
    pid = server.proc.pid
    body = {"text": "hello world, this is a test. " * 360_000, "sampling_params": {"max_new_tokens": 1}}
    before = front_rss_mib(pid)
    start = time.perf_counter()
    resp = server.post("/generate", json=body)
    elapsed = time.perf_counter() - start
    grown = front_rss_mib(pid) - before
    assert resp.status_code == 400, resp.text
    assert "is longer than the model's context length (2048 tokens)" in resp.json()["error"]["message"]
    assert elapsed < 5.0, elapsed
    assert grown < 200, f"front process RSS grew {grown:.0f} MiB"


def test_http_ten_megabyte_chat_message_is_refused_in_seconds(server):
    model = server.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 1,
            "messages": [{"role": "user", "content": "hello world, this is a test. " * 360_000}]}
    start = time.perf_counter()
    resp = server.post("/v1/chat/completions", json=body)
    assert time.perf_counter() - start < 5.0
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert "is longer than the model's context length (2048 tokens)" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_http_rid_in_flight_is_refused_naming_it(server):
    # "dup-N" must still be running when its twin arrives, however fast decoding has become (a
    # lone 1,500-token request once finished first, and later a 2,000-token one with eight
    # companions): each try runs up to the context with more companions in the batch, and a try
    # whose twin was accepted must show that the first had already finished.
    long = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
    refused = False
    for attempt in range(4):
        rids = [f"pad-{attempt}-{i}" for i in range(8 * (attempt + 1))] + [f"dup-{attempt}"]
        streams = [requests.post(server.url + "/generate", json={"text": "A story", "rid": rid, "stream": True,
                                                                 "sampling_params": long}, stream=True, timeout=60)
                   for rid in rids]
        try:
            first = streams[-1]
            lines = first.iter_lines()
            assert first.status_code == 200 and next(lines).startswith(b"data: ")  # running
            again = server.post("/generate", json={"text": "hi", "rid": rids[-1], "sampling_params": {"max_new_tokens": 1}})
            if again.status_code == 400:
                assert f"'{rids[-1]}'" in again.json()["error"]["message"]
                refused = True
            else:
                assert again.status_code == 200
                assert b"[DONE]" in b"".join(lines)  # accepted only because the first had finished
            for rid in rids:
                assert server.post("/abort_request", json={"rid": rid}).status_code == 200
        finally:
            for stream in streams:
                stream.close()
        if refused:
            break
    assert refused, "the first request finished before its twin arrived in every try"
