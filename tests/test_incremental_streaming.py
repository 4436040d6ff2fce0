"""Incremental streaming (issue 16, item 3): each update carries only what is new, on both hops
(scheduler -> detokenizer -> tokenizer manager), so its size does not grow with the output;
--stream-interval is honoured at the scheduler; the client still sees cumulative outputs, equal
to the non-streamed ones; the detokenizer frees a request's state at its finish or abort."""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List, Optional, Tuple

import pytest

from managers import ipc
from managers.detokenizer_manager import DetokenizerManager
from managers.generate_input import GenerateReqInput
from managers.io_struct import BatchTokenIDOut, SchedulerReady
from managers.scheduler import Scheduler
from managers.tokenizer_manager import TokenizerManager
from model_utils import random_prompts
from scheduler_utils import Harness
from srt.utils.hf_transformers_utils import get_tokenizer

GREEDY = {"temperature": 0, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "token_ids_logprob": [1, 2]}
VOLATILE = ("id", "e2e_latency")  # meta fields that differ between two runs of one request


class Pipeline:
    """Tokenizer manager -> scheduler -> detokenizer -> tokenizer manager in one process; every
    message crosses the typed IPC encoding, and each update's encoded size is recorded."""

    def __init__(self, model_path, tokenizer, **server_kw: Any):
        self.h = Harness(model_path, **server_kw)
        runner = self.h.runner
        self.h.sched = Scheduler(self.h.args, runner, tokenizer=tokenizer, send=self._from_scheduler)
        self.detok = DetokenizerManager(tokenizer)
        info = SchedulerReady(True, max_total_num_tokens=runner.max_total_num_tokens,
                              max_req_input_len=runner.max_req_input_len, max_req_len=runner.max_req_len,
                              max_running_requests=runner.max_running_requests,
                              context_len=runner.model_config.context_len, vocab_size=runner.model_config.vocab_size)
        self.tm = TokenizerManager(self.h.args, tokenizer, None, info, self._to_scheduler)
        self.token_msgs: List[BatchTokenIDOut] = []
        self.token_sizes: List[int] = []
        self.str_sizes: List[int] = []

    def _to_scheduler(self, msg: Any) -> None:
        self.h.sched.process_input(ipc.loads(ipc.dumps(msg)))

    def _from_scheduler(self, msg: Any) -> None:
        frames = ipc.dumps(msg)
        msg = ipc.loads(frames)
        if not isinstance(msg, BatchTokenIDOut):
            self.tm.handle_reply(msg)
            return
        self.token_msgs.append(msg)
        self.token_sizes.append(len(frames[1]))
        out = ipc.dumps(self.detok.handle(msg))
        self.str_sizes.append(len(out[1]))
        self.tm.handle_batch_str_out(ipc.loads(out))

    async def _generate(self, body: Dict[str, Any], stop_after: Optional[int]) -> List[Any]:
        outs: List[Any] = []

        async def consume() -> None:
            async for out in self.tm.generate_request(GenerateReqInput(**body)):
                outs.append(out)
                if stop_after is not None and len(outs) == stop_after:
                    break  # the client went away: the tokenizer manager aborts the request

        task = asyncio.ensure_future(consume())
        while not task.done() or not self.h.sched.is_idle():
            await asyncio.sleep(0)
            self.h.sched.step()
        await task
        return outs

    def generate(self, stop_after: Optional[int] = None, **body: Any) -> List[Any]:
        """Every update the client receives (one list of finals without streaming)."""
        return asyncio.run(asyncio.wait_for(self._generate(body, stop_after), 300))

    def close(self) -> None:
        self.tm.close()


@pytest.fixture(scope="module")
def tok(llama_model):
    return get_tokenizer(str(llama_model))


@pytest.fixture(scope="module")
def pipe(llama_model, tok):
    p = Pipeline(llama_model, tok, disable_radix_cache=True)  # cached_tokens stay 0 on repeats
    yield p
    p.close()


def prompt(seed: int, n: int = 12) -> List[int]:
    return random_prompts(1000, [n], seed=seed)[0]


def updates_of(msgs: List[BatchTokenIDOut]) -> Dict[Tuple[Optional[str], str], List[Tuple[int, List[int], Any]]]:
    """(offset, ids, finish) of every update, per (parent_rid, rid)."""
    per: Dict[Tuple[Optional[str], str], list] = {}
    for msg in msgs:
        for i, rid in enumerate(msg.rids):
            key = (msg.meta_info[i].get("parent_rid"), rid)
            per.setdefault(key, []).append((msg.output_offsets[i], msg.output_ids[i], msg.finished_reasons[i]))
    return per


def assert_sent_once(msgs: List[BatchTokenIDOut]) -> Dict[Tuple[Optional[str], str], List[int]]:
    """Each update starts where the previous one ended and the finish comes last, exactly once:
    no token is sent twice or skipped. Returns each request's whole output."""
    whole = {}
    for key, updates in updates_of(msgs).items():
        ids: List[int] = []
        for offset, piece, _ in updates:
            assert offset == len(ids), f"{key}: an update from {offset} after {len(ids)} ids"
            ids.extend(piece)
        assert [f is not None for *_, f in updates] == [False] * (len(updates) - 1) + [True], key
        whole[key] = ids
    return whole


def final(outs: List[Any]) -> Dict[str, Any]:
    assert outs[-1]["meta_info"]["finish_reason"] is not None
    return outs[-1]


def stable(meta: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in VOLATILE}


def assert_grows_cumulatively(outs: List[Any]) -> None:
    for before, after in zip(outs, outs[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]


# -- (1) the bytes of an update do not depend on how long the output already is ------------------

def test_update_size_is_independent_of_the_output_length(llama_model, tok):
    pipe = Pipeline(llama_model, tok)
    try:
        outs = pipe.generate(input_ids=prompt(1, 20), stream=True, return_logprob=True, top_logprobs_num=3,
                             sampling_params={"max_new_tokens": 1000, **GREEDY})
    finally:
        pipe.close()
    assert len(outs) == len(pipe.token_sizes) == 1000 and len(final(outs)["output_ids"]) == 1000
    for sizes in (pipe.token_sizes, pipe.str_sizes):
        running = sizes[9:999]  # steps 10 .. 999 (the finish at 1000 also carries its reason)
        assert max(running) / min(running) < 1.5, (min(running), max(running))
        assert abs(sizes[998] - sizes[9]) <= 16, (sizes[9], sizes[99], sizes[998])
        assert sum(sizes[899:999]) / 100 <= sum(sizes[9:109]) / 100 + 8  # no growth trend
        assert sizes[999] < 2 * sizes[9]


# -- (2) streamed outputs add up to the non-streamed one ------------------------------------------

@pytest.mark.parametrize("extra", [{}, LOGPROBS], ids=["plain", "logprobs"])
def test_streamed_output_equals_the_non_streamed_one(pipe, extra):
    body = dict(input_ids=prompt(2), sampling_params={"max_new_tokens": 30, **GREEDY}, **extra)
    whole = pipe.generate(**body)[0]
    pipe.token_msgs.clear()
    outs = pipe.generate(stream=True, **body)
    assert len(outs) == 30
    assert_grows_cumulatively(outs)
    last = final(outs)
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert stable(last["meta_info"]) == stable(whole["meta_info"])
    assert_sent_once(pipe.token_msgs)
    if extra:
        for out in outs:  # cumulative logprobs in every update; input logprobs in each of them
            meta = out["meta_info"]
            assert len(meta["output_token_logprobs"]) == len(out["output_ids"]) == meta["completion_tokens"]
            assert len(meta["output_top_logprobs"]) == len(meta["output_token_ids_logprobs"]) == len(out["output_ids"])
            assert meta["input_token_logprobs"] == whole["meta_info"]["input_token_logprobs"]
        first_update = pipe.token_msgs[0].meta_info[0]
        assert first_update["input_token_logprobs"] and pipe.token_msgs[1].meta_info[0]["input_token_logprobs"] is None


def test_streamed_output_with_a_stop_string_is_trimmed_like_the_non_streamed_one(pipe):
    body = dict(input_ids=prompt(3), sampling_params={"max_new_tokens": 40, **GREEDY})
    text = pipe.generate(**body)[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {text!r}"
    body["sampling_params"] = {**body["sampling_params"], "stop": [stop]}
    whole = pipe.generate(**body)[0]
    assert whole["meta_info"]["finish_reason"]["type"] == "stop" and stop not in whole["text"]
    outs = pipe.generate(stream=True, **body)
    assert_grows_cumulatively(outs)
    assert all(stop not in out["text"] for out in outs)  # never streamed, then trimmed
    last = final(outs)
    assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
    assert last["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]


def test_streamed_n_greater_than_one_children_each_equal_the_non_streamed_ones(pipe):
    body = dict(input_ids=prompt(4), sampling_params={"max_new_tokens": 12, "n": 3, **GREEDY}, **LOGPROBS)
    wholes = pipe.generate(**body)[0]
    pipe.token_msgs.clear()
    outs = pipe.generate(stream=True, **body)
    by_index: Dict[int, List[Any]] = {}
    for out in outs:
        by_index.setdefault(out["index"], []).append(out)
    assert sorted(by_index) == [0, 1, 2]
    for index, child in by_index.items():
        assert_grows_cumulatively(child)
        last, whole = final(child), wholes[index]
        assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
        assert stable(last["meta_info"]) == stable(whole["meta_info"])
    assert len(assert_sent_once(pipe.token_msgs)) == 3


def test_a_request_finishing_at_its_prefill_streams_one_update(pipe):
    body = dict(input_ids=prompt(5), sampling_params={"max_new_tokens": 1, **GREEDY}, **LOGPROBS)
    whole = pipe.generate(**body)[0]
    outs = pipe.generate(stream=True, **body)
    assert len(outs) == 1
    assert (outs[0]["text"], outs[0]["output_ids"]) == (whole["text"], whole["output_ids"])
    assert stable(outs[0]["meta_info"]) == stable(whole["meta_info"])


def test_retracted_streams_send_no_token_twice_and_match_the_plain_run(pipe, monkeypatch):
    bodies = [dict(input_ids=prompt(10 + i), sampling_params={"max_new_tokens": 14, **GREEDY}, **LOGPROBS)
              for i in range(3)]
    expected = [pipe.generate(**b)[0] for b in bodies]
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "3")
    pipe.token_msgs.clear()
    before = pipe.h.sched.stats["num_retractions"]

    async def all_streams():
        return await asyncio.gather(*(pipe._generate({**b, "stream": True}, None) for b in bodies))

    streams = asyncio.run(asyncio.wait_for(all_streams(), 300))
    monkeypatch.delenv("SRT_TEST_RETRACT_INTERVAL")
    assert pipe.h.sched.stats["num_retractions"] > before
    assert_sent_once(pipe.token_msgs)
    assert sum(final(outs)["meta_info"]["total_retractions"] for outs in streams) > 0
    for outs, whole in zip(streams, expected):
        assert_grows_cumulatively(outs)
        last = final(outs)
        assert (last["text"], last["output_ids"]) == (whole["text"], whole["output_ids"])
        got, want = last["meta_info"]["output_token_logprobs"], whole["meta_info"]["output_token_logprobs"]
        assert [e[1] for e in got] == [e[1] for e in want] == last["output_ids"]  # one entry per token
        assert [e[0] for e in got] == pytest.approx([e[0] for e in want], abs=1e-4)  # re-prefill numerics


# -- (3) the detokenizer keeps a request's state only while it runs ------------------------------

def test_detokenizer_state_lives_while_streaming_and_is_freed_at_the_finish(pipe):
    seen = []
    original = pipe.detok.handle

    def spy(msg):
        out = original(msg)
        seen.append(len(pipe.detok.decode_status))
        return out

    pipe.detok.handle = spy
    try:
        pipe.generate(input_ids=prompt(6), stream=True, sampling_params={"max_new_tokens": 8, **GREEDY})
    finally:
        pipe.detok.handle = original
    assert seen == [1] * 7 + [0]
    assert not pipe.detok.decode_status and not pipe.tm.rid_to_state


def test_detokenizer_state_is_freed_when_the_client_goes_away_mid_stream(pipe):
    pipe.token_msgs.clear()
    outs = pipe.generate(stop_after=5, input_ids=prompt(7), stream=True,
                         sampling_params={"max_new_tokens": 200, **GREEDY})
    assert len(outs) == 5
    updates = list(updates_of(pipe.token_msgs).values())[0]
    assert updates[-1][2]["type"] == "abort" and len(updates) < 200
    assert_sent_once(pipe.token_msgs)
    assert not pipe.detok.decode_status and not pipe.tm.rid_to_state and not pipe.tm._draining


def test_detokenizer_state_is_freed_after_an_abort_request(pipe):
    async def scenario():
        task = asyncio.ensure_future(pipe._generate(
            dict(input_ids=prompt(8), rid="cut", stream=True, sampling_params={"max_new_tokens": 200, **GREEDY}),
            None))
        while len(pipe.detok.decode_status) == 0:
            await asyncio.sleep(0)
        await pipe.tm.abort_request("cut")
        return await task

    outs = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert final(outs)["meta_info"]["finish_reason"]["type"] == "abort"
    assert_grows_cumulatively(outs)
    assert not pipe.detok.decode_status and not pipe.tm.rid_to_state


# -- (4) --stream-interval at the scheduler ---------------------------------------------------------

@pytest.fixture(scope="module")
def every_four(llama_model, tok):
    p = Pipeline(llama_model, tok, stream_interval=4)
    yield p
    p.close()


def test_stream_interval_sends_the_first_token_then_every_fourth_and_the_finish(every_four):
    every_four.token_msgs.clear()
    outs = every_four.generate(input_ids=prompt(9), stream=True, sampling_params={"max_new_tokens": 40, **GREEDY})
    assert len(every_four.token_msgs) == 11
    updates = list(updates_of(every_four.token_msgs).values())[0]
    assert [len(ids) for _, ids, _ in updates] == [1, 3] + [4] * 9
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [1] + list(range(4, 41, 4))
    assert len(final(outs)["output_ids"]) == 40


def test_a_non_streaming_request_is_sent_once_at_its_finish(every_four):
    every_four.token_msgs.clear()
    outs = every_four.generate(input_ids=prompt(9), sampling_params={"max_new_tokens": 40, **GREEDY})
    assert len(every_four.token_msgs) == 1 and len(outs[0]["output_ids"]) == 40
    assert every_four.token_msgs[0].output_offsets == [0] and every_four.token_msgs[0].input_tail_ids[0]
