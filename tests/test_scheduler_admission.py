"""Admission limits, cached_tokens, abort and n > 1."""

from __future__ import annotations

from managers.io_struct import AbortReq, FlushCacheReqInput
from model_utils import random_prompts
from scheduler_utils import Harness


def test_cached_tokens_repeat_extension_and_namespaces(llama_model):
    h = Harness(llama_model)
    p = random_prompts(1000, [30], seed=30)[0]
    h.submit("a", p, max_new_tokens=6, temperature=0)
    a = h.run()["a"]
    assert a["meta"]["cached_tokens"] == 0
    h.submit("b", p, max_new_tokens=6, temperature=0)
    assert h.run()["b"]["meta"]["cached_tokens"] == len(p) - 1  # exact repeat: L - 1
    turn2 = p + a["output_ids"] + random_prompts(1000, [7], seed=31)[0]
    h.submit("c", turn2, max_new_tokens=4, temperature=0)
    # The previous prompt + output has KV except the last sampled token.
    assert h.run()["c"]["meta"]["cached_tokens"] == len(p) + len(a["output_ids"]) - 1
    h.submit("d", p, max_new_tokens=2, temperature=0, extra_key="tenant-2")
    assert h.run()["d"]["meta"]["cached_tokens"] == 0
    h.submit("e", p, max_new_tokens=2, temperature=0, extra_key="tenant-2")
    assert h.run()["e"]["meta"]["cached_tokens"] == len(p) - 1
    h.assert_conserved()


def test_input_length_boundary_from_kv_pool(llama_model):
    T = 48
    h = Harness(llama_model, max_total_tokens=T)
    M = min(h.runner.model_config.context_len - 1, T - 1) - 5  # 42
    ids = random_prompts(1000, [M], seed=32)[0]
    h.submit("ok", ids[: M - 1], max_new_tokens=100, temperature=0, ignore_eos=True)
    h.submit("bad", ids, max_new_tokens=4, temperature=0)
    out = h.run()
    ok = out["ok"]
    assert ok["finish"]["type"] == "length"
    assert (M - 1) + len(ok["output_ids"]) <= T - 2  # max_new_tokens clamped to the pool
    bad = out["bad"]["finish"]
    assert bad["type"] == "abort" and bad["status_code"] == 400
    assert bad["message"].startswith(f"Input length ({M} tokens) exceeds the maximum allowed length ({M} tokens). "
                                     "Use a shorter input or enable --allow-auto-truncate.")
    assert f"KV cache pool ({T} tokens)" in bad["message"]
    h.assert_conserved()


def test_input_length_boundary_from_context_length(tiny_model_factory):
    path = tiny_model_factory("llama", context=64)
    h = Harness(path, max_total_tokens=4096)
    M = 64 - 1 - 5
    ids = random_prompts(1000, [M], seed=33)[0]
    h.submit("bad", ids, max_new_tokens=1)
    msg = h.run()["bad"]["finish"]["message"]
    assert f"({M} tokens)" in msg and "context length (64 tokens" in msg
    h.assert_conserved()


def test_auto_truncate_keeps_first_tokens_and_reports(llama_model):
    h = Harness(llama_model, max_total_tokens=48, allow_auto_truncate=True)
    ids = random_prompts(1000, [60], seed=34)[0]
    h.submit("t", ids, max_new_tokens=3, temperature=0, ignore_eos=True)
    out = h.run()["t"]
    assert out["meta"]["truncated_input_tokens"] == 60
    assert out["meta"]["prompt_tokens"] == 42
    assert out["finish"]["type"] == "length"
    h.assert_conserved()


def test_bad_sampling_params_refused_with_name_and_value(llama_model):
    h = Harness(llama_model)
    h.submit("x", [5, 6, 7], temperature=-1.0)
    fin = h.run()["x"]["finish"]
    assert fin["status_code"] == 400 and "temperature" in fin["message"] and "-1" in fin["message"]
    h.assert_conserved()


def test_queue_full_is_503(llama_model):
    h = Harness(llama_model, max_queued_requests=2)
    for i in range(3):
        h.submit(f"w{i}", [5, 6, 7, i + 8], max_new_tokens=2)
    refused = h.finals()["w2"]["finish"]
    assert refused["status_code"] == 503 and refused["message"].startswith("The request queue is full.")
    assert set(h.run()) == {"w0", "w1", "w2"}
    h.assert_conserved()


def test_abort_waiting_and_running(llama_model):
    h = Harness(llama_model, max_running_requests=1)
    for i in range(3):
        h.submit(f"job-{i}", random_prompts(1000, [12], seed=40 + i)[0], max_new_tokens=50, ignore_eos=True)
    h.sched.step()  # job-0 prefilled and running; the others wait
    h.sched.step()
    for i in range(3):  # aborts match exact rids (issue 15): one per request
        h.sched.process_input(AbortReq(rid=f"job-{i}"))
    out = h.run()
    assert set(out) == {"job-0", "job-1", "job-2"}
    for f in out.values():
        assert f["finish"]["type"] == "abort"
    assert len(out["job-0"]["output_ids"]) < 50
    h.assert_conserved()


def test_n_samples_share_prefix_and_differ(llama_model):
    h = Harness(llama_model)
    p = random_prompts(1000, [25], seed=50)[0]
    h.submit("s", p, n=4, max_new_tokens=8, temperature=1.0, sampling_seed=7, ignore_eos=True)
    out = h.run()
    kids = [out[f"s-{i}"] for i in range(4)]
    assert len({tuple(k["output_ids"]) for k in kids}) > 1
    assert all(k["meta"]["cached_tokens"] == len(p) - 1 for k in kids)
    assert "s::prefix" not in out
    h.submit("g", p, n=3, max_new_tokens=8, temperature=0, ignore_eos=True)
    out = h.run()
    assert len({tuple(out[f"g-{i}"]["output_ids"]) for i in range(3)}) == 1
    h.assert_conserved()


# The lone request that runs out of KV at decode: tests/error_contract/test_running_contract.py.


def test_flush_cache_only_when_idle(llama_model):
    h = Harness(llama_model)
    h.submit("a", [5, 6, 7, 8], max_new_tokens=30, ignore_eos=True)
    h.sched.step()
    h.sched.process_input(FlushCacheReqInput())
    assert h.outbox[-1].success is False
    h.run()
    h.sched.process_input(FlushCacheReqInput())
    assert h.outbox[-1].success is True
    assert h.sched.tree_cache.evictable_size() == 0
    h.assert_conserved()


def test_get_load_reports_live_numbers(llama_model):
    from managers.io_struct import GetLoadReqInput, GetLoadReqOutput

    h = Harness(llama_model)
    h.submit("a", [5, 6, 7, 8], max_new_tokens=5, ignore_eos=True)
    h.sched.step()
    h.sched.process_input(GetLoadReqInput())
    load = h.outbox[-1]
    assert isinstance(load, GetLoadReqOutput)
    assert load.num_running_reqs == 1 and load.num_waiting_reqs == 0 and 0 < load.token_usage < 1
    assert load.counters["prefix_queried_tokens"] == 4
    h.run()
    h.assert_conserved()
