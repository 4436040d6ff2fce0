"""Scheduler hardening (issue 15): exact-rid aborts, n > 1 children tied to their parent, the
queue bound counting every child, retraction headroom, and honest counters. Every scenario ends
with the KV conservation check and no request slot in use."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import pytest

from managers.io_struct import AbortReq, BatchTokenIDOut, FlushCacheReqInput
from model_utils import random_prompts
from scheduler_utils import Harness


def finals_by_key(h: Harness) -> Dict[Tuple[Optional[str], str], dict]:
    """Final outputs keyed by (parent_rid, rid): a user rid may equal an n > 1 child's name."""
    out: Dict[Tuple[Optional[str], str], dict] = {}
    for msg in h.outbox:
        if not isinstance(msg, BatchTokenIDOut):
            continue
        for rid, ids, fin, meta in zip(msg.rids, msg.output_ids, msg.finished_reasons, msg.meta_info):
            if fin is not None:
                key = (meta.get("parent_rid"), rid)
                assert key not in out, f"{key} finished twice"
                out[key] = {"output_ids": ids, "finish": fin, "meta": meta}
    return out


def prompt(seed: int, n: int = 12):
    return random_prompts(1000, [n], seed=seed)[0]


# -- aborts match exact rids; n > 1 children through their parent ----------------------------------

def test_abort_matches_the_exact_rid_not_a_prefix(llama_model):
    h = Harness(llama_model)
    h.submit("req-1", prompt(1), max_new_tokens=30, ignore_eos=True)
    h.submit("req-10", prompt(2), max_new_tokens=30, ignore_eos=True)
    h.sched.step()
    h.sched.process_input(AbortReq(rid="req-1"))
    out = h.run()
    assert out["req-1"]["finish"]["type"] == "abort"
    assert out["req-10"]["finish"] == {"type": "length", "length": 30}
    h.assert_conserved()


@pytest.mark.parametrize("steps", [0, 3], ids=["waiting", "running"])
def test_abort_of_a_user_rid_leaves_the_same_named_child_of_an_n_request_alone(llama_model, steps):
    h = Harness(llama_model)
    h.submit("abc", prompt(3), n=2, max_new_tokens=20, ignore_eos=True)
    h.submit("abc-0", prompt(4), max_new_tokens=20, ignore_eos=True)
    for _ in range(steps):
        h.sched.step()
    h.sched.process_input(AbortReq(rid="abc-0"))
    h.sched.run_until_idle()  # not h.run(): its finals are keyed by rid alone
    out = finals_by_key(h)
    assert out[(None, "abc-0")]["finish"]["type"] == "abort"
    for i in range(2):
        assert out[("abc", f"abc-{i}")]["finish"] == {"type": "length", "length": 20}
    h.assert_conserved()


@pytest.mark.parametrize("steps", [0, 1, 3], ids=["parked", "released", "running"])
def test_abort_of_an_n_request_aborts_every_child(llama_model, steps):
    h = Harness(llama_model)
    h.submit("job", prompt(5), n=3, max_new_tokens=30, ignore_eos=True)
    for _ in range(steps):
        h.sched.step()
    h.sched.process_input(AbortReq(rid="job"))
    h.run()
    out = finals_by_key(h)
    assert set(out) == {("job", f"job-{i}") for i in range(3)}
    assert all(f["finish"]["type"] == "abort" for f in out.values())
    h.assert_conserved()


def test_internal_prefix_name_is_not_a_user_namespace(llama_model):
    """A user rid equal to the internal prefix request's name neither aborts nor releases it."""
    h = Harness(llama_model)
    h.submit("x", prompt(6), n=2, max_new_tokens=5, ignore_eos=True)
    h.submit("x::prefix", prompt(7), max_new_tokens=5, ignore_eos=True)
    h.sched.process_input(AbortReq(rid="x::prefix"))
    h.run()
    out = finals_by_key(h)
    assert out[(None, "x::prefix")]["finish"]["type"] == "abort"
    assert all(out[("x", f"x-{i}")]["finish"]["type"] == "length" for i in range(2))
    h.assert_conserved()


# -- a failed prefix fails its children ----------------------------------------------------------

def test_children_of_a_failed_prefix_request_finish_with_its_error(llama_model):
    h = Harness(llama_model, max_running_requests=4)
    h.submit("warm", prompt(8), max_new_tokens=1)
    h.run()  # the prompt is cached: the prefix request locks a real node on admission
    rows = h.runner.req_to_token_pool
    hog = rows.alloc(rows.available_size())  # every request slot taken: the prefix's extend fails
    h.submit("n3", prompt(8), n=3, max_new_tokens=4, ignore_eos=True)
    h.sched.step()
    rows.free(hog)
    h.sched.run_until_idle(max_steps=50)
    out = {k: v for k, v in finals_by_key(h).items() if k[0] == "n3"}
    assert set(out) == {("n3", f"n3-{i}") for i in range(3)}
    for f in out.values():
        assert f["finish"]["type"] == "abort" and f["finish"]["status_code"] == 503
        assert "alloc_req_slots" in f["finish"]["message"]
    assert h.sched.is_idle()
    h.sched.process_input(FlushCacheReqInput())
    assert h.outbox[-1].success is True
    h.assert_conserved()


# -- the queue bound counts every child ----------------------------------------------------------

def test_parked_children_count_against_max_queued_requests(llama_model):
    h = Harness(llama_model, max_queued_requests=3)
    h.submit("a", prompt(9), n=2, max_new_tokens=2)
    h.submit("b", prompt(10), n=2, max_new_tokens=2)  # 2 queued + 2 > 3
    h.submit("c", prompt(11), max_new_tokens=2)  # 2 queued + 1 fits
    refused = h.finals()["b"]["finish"]
    assert refused["status_code"] == 503 and refused["message"].startswith("The request queue is full.")
    assert "--max-queued-requests=3" in refused["message"]
    h.run()
    out = finals_by_key(h)
    assert {k for k, f in out.items() if f["finish"]["type"] == "length"} == {("a", "a-0"), ("a", "a-1"), (None, "c")}
    h.assert_conserved()


def test_n_above_the_queue_bound_is_refused_with_400(llama_model):
    h = Harness(llama_model, max_queued_requests=3)
    h.submit("big", prompt(12), n=4, max_new_tokens=2)
    refused = h.finals()["big"]["finish"]
    assert refused["status_code"] == 400
    assert "n=4" in refused["message"] and "--max-queued-requests=3" in refused["message"]
    assert h.sched.is_idle()
    h.assert_conserved()


def test_get_load_counts_parked_children_as_waiting(llama_model):
    h = Harness(llama_model)
    h.submit("p", prompt(13), n=4, max_new_tokens=2)
    assert h.sched.get_load().num_waiting_reqs == 4
    h.run()
    h.assert_conserved()


# -- retraction keeps SGLang's headroom ----------------------------------------------------------

def _retraction_events(h: Harness):
    events = []
    original = h.sched._after_retract

    def record(retracted):
        if retracted:
            events.append(h.sched.decode_ct)
        original(retracted)

    h.sched._after_retract = record
    return events


def test_a_retraction_buys_many_decode_steps(llama_model):
    """16 requests sharing a 64-token prefix, each freeing only a few private slots when
    retracted: stopping as soon as one step fits retracted every 1-3 steps (11 times)."""
    h = Harness(llama_model, max_total_tokens=400, schedule_conservativeness=0.3)
    base = prompt(14, 64)
    for i, tail in enumerate(random_prompts(1000, [2] * 16, seed=15)):
        h.submit(f"t{i}", base + tail, max_new_tokens=60, temperature=0, ignore_eos=True)
    events = _retraction_events(h)
    out = h.run()
    assert all(f["finish"] == {"type": "length", "length": 60} for f in out.values())
    assert events, "the workload must retract"
    gaps = [b - a for a, b in zip(events, events[1:])]
    assert len(events) <= 4 and all(g >= 10 for g in gaps), (events, gaps)
    h.assert_conserved()


def test_forced_retraction_under_a_real_shortage_keeps_every_request(llama_model, monkeypatch):
    """The test hook retracts one request; when memory is still short the normal retraction
    runs. Before the fix the other running requests were dropped with their rows and locks."""
    h = Harness(llama_model)
    p = prompt(16)
    h.submit("A", p, max_new_tokens=20, temperature=0, ignore_eos=True)
    h.sched.step(), h.sched.step()
    h.submit("B", p, max_new_tokens=20, temperature=0, ignore_eos=True)
    h.sched.step(), h.sched.step()
    h.submit("C", p, max_new_tokens=20, temperature=0, ignore_eos=True)
    h.sched.step()  # C prefilled: fewest outputs, no private slots, its prefix locked by A and B
    assert [len(r.output_ids) for r in h.sched.running_batch.reqs] == [3, 2, 1]
    alloc = h.runner.token_to_kv_pool_allocator
    h.sched.tree_cache.evict(h.sched.tree_cache.evictable_size())
    hog = alloc.alloc(alloc.available_size())  # nothing free, nothing evictable
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", str(h.sched.decode_ct))
    h.sched.step()  # forced: C goes, which frees nothing; B must go too so that A can decode
    monkeypatch.delenv("SRT_TEST_RETRACT_INTERVAL")
    assert [r.rid for r in h.sched.running_batch.reqs] == ["A"]
    alloc.free(hog)
    out = h.run()
    assert {rid: f["finish"]["type"] for rid, f in out.items()} == {"A": "length", "B": "length", "C": "length"}
    h.assert_conserved()


# -- counters ------------------------------------------------------------------------------------

def test_generated_tokens_counts_only_sampled_tokens(llama_model):
    h = Harness(llama_model, chunked_prefill_size=8)
    h.submit("chunked", prompt(17, 30), max_new_tokens=5, ignore_eos=True)
    h.submit("prefill-only", prompt(18), max_new_tokens=0)
    h.submit("fan", prompt(19), n=2, max_new_tokens=3, ignore_eos=True)
    out = h.run()
    assert sum(len(f["output_ids"]) for f in out.values()) == 5 + 0 + 2 * 3
    assert h.sched.stats["generated_tokens"] == 11
    h.assert_conserved()
