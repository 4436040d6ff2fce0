"""`--dp-size 2`: two scheduler replicas behind one front end. Both serve, greedy results equal
DP = 1, totals and per-replica numbers are reported; the controller's choices are SGLang's."""

from __future__ import annotations

import concurrent.futures

import pytest

from managers.data_parallel_controller import DataParallelController, merge_loads
from managers.io_struct import AbortReq, GetLoadReqOutput, TokenizedGenerateReqInput
from model_utils import random_prompts
from server_utils import running_server
from srt.sampling.sampling_params import SamplingParams

ARGS = ("--max-total-tokens", "4096", "--max-running-requests", "16", "--enable-metrics")
PARAMS = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def _req(rid):
    return TokenizedGenerateReqInput(rid, [1, 2], SamplingParams())


def test_round_robin_alternates_and_shortest_queue_follows_in_flight_counts():
    sent = [[], []]
    rr = DataParallelController([sent[0].append, sent[1].append], "round_robin")
    for i in range(5):
        rr.send(_req(f"r{i}"))
    assert [m.rid for m in sent[0]] == ["r0", "r2", "r4"] and [m.rid for m in sent[1]] == ["r1", "r3"]
    rr.send(AbortReq(rid="r1"))
    assert isinstance(sent[0][-1], AbortReq) and isinstance(sent[1][-1], AbortReq)

    sq = DataParallelController([lambda m: None, lambda m: None], "shortest_queue")
    for rid in ("a", "b", "c"):
        sq.send(_req(rid))
    assert sq.owner == {"a": 0, "b": 1, "c": 0} and sq.inflight == [2, 1]
    sq.release("a")
    sq.release("c")
    sq.send(_req("d"))
    assert sq.owner["d"] == 0 and sq.inflight == [1, 1]
    with pytest.raises(ValueError, match="round_robin, shortest_queue"):
        DataParallelController([print], "random")


def test_merged_load_sums_replicas_and_keeps_each():
    a = GetLoadReqOutput(2, 1, 0.5, 100, {"num_requests": 3}, dp_rank=1)
    b = GetLoadReqOutput(1, 0, 0.25, 300, {"num_requests": 5}, dp_rank=0)
    total = merge_loads([a, b])
    assert (total.num_running_reqs, total.num_waiting_reqs, total.max_total_num_tokens) == (3, 1, 400)
    assert total.token_usage == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)
    assert total.counters["num_requests"] == 8
    assert [r["dp_rank"] for r in total.replicas] == [0, 1]


def _generate_each(handle, prompts):
    """One request per prompt, concurrently (so the controller spreads them)."""
    def one(p):
        r = handle.post("/generate", json={"input_ids": p, "sampling_params": PARAMS}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue"])
def test_dp2_serves_on_both_replicas_with_dp1_results(llama_model, method):
    prompts = random_prompts(512, [5 + (7 * i) % 29 for i in range(12)], seed=4)
    with running_server(llama_model, *ARGS) as one:
        expected = _generate_each(one, prompts)
    with running_server(llama_model, *ARGS, "--dp-size", "2", "--load-balance-method", method) as two:
        assert _generate_each(two, prompts) == expected
        info = two.get("/get_server_info").json()
        replicas = info["load"]["replicas"]
        assert info["dp_size"] == 2 and [r["dp_rank"] for r in replicas] == [0, 1]
        counts = [r["counters"]["num_requests"] for r in replicas]
        assert min(counts) > 0 and sum(counts) == info["load"]["counters"]["num_requests"] >= len(prompts)
        assert info["load"]["max_total_num_tokens"] == sum(r["max_total_num_tokens"] for r in replicas)
        mem = info["load"]["memory"]  # conservation summed over the replicas, each replica's own too
        for m, total in [(mem, info["load"]["max_total_num_tokens"])] + [(r["memory"], r["max_total_num_tokens"])
                                                                         for r in replicas]:
            assert m["available_size"] + m["evictable_size"] + m["protected_size"] == total
            assert m["protected_size"] == 0 and m["num_free_req_slots"] == m["num_req_slots"]
        metrics = two.get("/metrics").text
        for d in (0, 1):
            line = next(l for l in metrics.splitlines() if l.startswith("sglang:dp_num_requests{")
                        and f'dp_rank="{d}"' in l)
            assert float(line.rsplit(" ", 1)[1]) == counts[d]
        assert two.post("/flush_cache").status_code == 200
        before = counts[1]
        for _ in range(3):  # a named replica wins over the balancer
            r = two.post("/generate", json={"input_ids": prompts[0], "data_parallel_rank": 1, "sampling_params": PARAMS})
            assert r.status_code == 200 and r.json()["output_ids"] == expected[0]
        after = two.get("/get_server_info").json()["load"]["replicas"][1]["counters"]["num_requests"]
        assert after == before + 3


def test_dp2_times_tp2_runs_four_ranks_with_dp1_results(llama_model):
    prompts = random_prompts(512, [5, 9, 13, 6], seed=8)
    with running_server(llama_model, *ARGS) as one:
        expected = _generate_each(one, prompts)
    with running_server(llama_model, *ARGS, "--dp-size", "2", "--tp-size", "2") as both:
        assert _generate_each(both, prompts) == expected
        info = both.get("/get_server_info").json()
        assert set(info["pids"]) == {"Scheduler", "Scheduler TP1", "Scheduler DP1", "Scheduler DP1 TP1", "Detokenizer"}
        assert min(r["counters"]["num_requests"] for r in info["load"]["replicas"]) > 0
