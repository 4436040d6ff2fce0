"""Greedy outputs through the scheduler loop do not depend on how the work was scheduled."""

from __future__ import annotations

import pytest

from model_utils import random_prompts
from scheduler_utils import Harness

MAX_NEW = [12, 5, 9, 14, 7, 10]


def _prompts(vocab):
    base = random_prompts(vocab, (40,), seed=20)[0]
    tails = random_prompts(vocab, (3, 30, 11, 1, 52, 8), seed=21)
    # Two pairs share a 40-token prefix so the radix cache and lpm have something to find.
    return [base + tails[0], tails[1], base + tails[2], tails[3], tails[4], base[:20] + tails[5]]


@pytest.fixture(scope="module")
def reference(llama_model):
    """Each prompt alone, no cache, no chunking: the plainest schedule."""
    h = Harness(llama_model, disable_radix_cache=True)
    vocab = h.runner.model_config.vocab_size
    outs = {}
    for i, (p, n) in enumerate(zip(_prompts(vocab), MAX_NEW)):
        h.submit(f"r{i}", p, max_new_tokens=n, temperature=0, ignore_eos=True)
        outs[f"r{i}"] = h.run()[f"r{i}"]["output_ids"]
    h.assert_conserved()
    return outs


CONFIGS = [
    dict(),
    dict(chunked_prefill_size=16),
    dict(chunked_prefill_size=64, page_size=16),
    dict(page_size=16),
    dict(disable_radix_cache=True, chunked_prefill_size=16),
    dict(schedule_policy="lpm", page_size=16, chunked_prefill_size=16),
    dict(schedule_policy="dfs-weight", chunked_prefill_size=64),
    dict(schedule_policy="lof"),
    dict(schedule_policy="random", page_size=16),
    dict(schedule_policy="lpm", disable_radix_cache=True),
    dict(max_prefill_tokens=20),
    dict(max_running_requests=2),
    dict(enable_mixed_chunk=True, max_prefill_tokens=20),
    dict(enable_mixed_chunk=True, max_running_requests=2, chunked_prefill_size=16, page_size=16),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_mixed_batch_greedy_matches_reference(llama_model, reference, config):
    config = dict(config)
    h = Harness(llama_model, max_running_requests=config.pop("max_running_requests", 32), **config)
    vocab = h.runner.model_config.vocab_size
    for i, (p, n) in enumerate(zip(_prompts(vocab), MAX_NEW)):
        h.submit(f"r{i}", p, max_new_tokens=n, temperature=0, ignore_eos=True)
    finals = h.run()
    assert {rid: f["output_ids"] for rid, f in finals.items()} == reference
    for rid, f in finals.items():
        assert f["finish"] == {"type": "length", "length": len(reference[rid])}
    h.assert_conserved()


def test_memory_pressure_retracts_and_still_matches(llama_model):
    """A pool of ~11% of the working set (12 x (8 + 40) tokens), admitted optimistically (low
    --schedule-conservativeness): everything finishes, identically, with retractions."""
    prompts = random_prompts(1000, [8] * 12, seed=22)
    free = Harness(llama_model)
    for i, p in enumerate(prompts):
        free.submit(f"q{i}", p, max_new_tokens=40, temperature=0, ignore_eos=True)
    expected = {rid: f["output_ids"] for rid, f in free.run().items()}

    tight = Harness(llama_model, max_total_tokens=64, schedule_conservativeness=0.1)
    for i, p in enumerate(prompts):
        tight.submit(f"q{i}", p, max_new_tokens=40, temperature=0, ignore_eos=True, return_logprob=True)
    finals = tight.run()
    assert {rid: f["output_ids"] for rid, f in finals.items()} == expected
    assert tight.sched.stats["num_retractions"] > 0
    assert sum(f["meta"]["total_retractions"] for f in finals.values()) > 0
    for f in finals.values():  # one logprob per output token, even after retractions
        assert len(f["meta"]["output_token_logprobs"]) == len(f["output_ids"])
    tight.assert_conserved()


def test_forced_retraction_hook(llama_model, monkeypatch):
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "3")
    prompts = random_prompts(1000, [9, 14, 6], seed=23)
    h = Harness(llama_model)
    for i, p in enumerate(prompts):
        h.submit(f"f{i}", p, max_new_tokens=12, temperature=0, ignore_eos=True, return_logprob=True)
    finals = h.run()
    monkeypatch.delenv("SRT_TEST_RETRACT_INTERVAL")
    ref = Harness(llama_model)
    for i, p in enumerate(prompts):
        ref.submit(f"f{i}", p, max_new_tokens=12, temperature=0, ignore_eos=True)
    expected = ref.run()
    assert h.sched.stats["num_retractions"] > 0
    for rid, f in finals.items():
        assert f["output_ids"] == expected[rid]["output_ids"]
        assert len(f["meta"]["output_token_logprobs"]) == 12
    h.assert_conserved()


def test_stop_token_id_finishes_with_matched(llama_model):
    h = Harness(llama_model)
    prompt = random_prompts(1000, [10], seed=24)[0]
    h.submit("a", prompt, max_new_tokens=8, temperature=0, ignore_eos=True)
    first = h.run()["a"]["output_ids"]
    h.submit("b", prompt, max_new_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[first[3]])
    out = h.run()["b"]
    stop_at = first.index(first[3])
    assert out["output_ids"] == first[: stop_at + 1]
    assert out["finish"] == {"type": "stop", "matched": first[3]}
    h.assert_conserved()
