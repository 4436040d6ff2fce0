"""--enable-mixed-chunk: running requests take their decode step inside the next prefill batch.
Oracle: the same arrivals without the flag (greedy and seeded draws are the same tokens); the
flag must save forwards, and every KV slot must be accounted for at the end."""

from __future__ import annotations

import pytest

from model_utils import random_prompts
from scheduler_utils import Harness

LENS = (9, 30, 14, 41, 5, 23)


def _staggered(model, arrivals_every=3, n_new=10, sampling=None, lens=LENS, **config):
    """Request i arrives after `arrivals_every` scheduler steps of the ones before it, so each
    prefill meets requests that are decoding. Also returns the step at which each request finished."""
    h = Harness(model, **config)
    prompts = random_prompts(h.runner.model_config.vocab_size, lens, seed=31)
    finished_at, step = {}, 0

    def one_step():
        nonlocal step
        seen = len(h.outbox)
        busy = h.sched.step()
        step += 1
        for msg in h.outbox[seen:]:
            for rid, fin in zip(getattr(msg, "rids", ()), getattr(msg, "finished_reasons", ())):
                if fin is not None:
                    finished_at[rid] = step
        return busy

    for i, p in enumerate(prompts):
        params = dict(max_new_tokens=n_new + i, ignore_eos=True, **(sampling(i) if sampling else dict(temperature=0)))
        h.submit(f"m{i}", p, **params)
        for _ in range(arrivals_every):
            one_step()
    while one_step() or h.sched.waiting_queue:
        pass
    finals = h.finals()
    assert set(finished_at) == set(finals)
    h.assert_conserved()
    h.finished_at = finished_at
    return h, finals


def _ids(finals):
    return {rid: f["output_ids"] for rid, f in finals.items()}


CONFIGS = [
    dict(),
    dict(page_size=16),
    dict(chunked_prefill_size=8),  # a long prompt's chunks each carry the running decodes
    dict(chunked_prefill_size=16, page_size=16, schedule_policy="lpm"),
    dict(disable_radix_cache=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_mixed_greedy_equals_unmixed_with_fewer_forwards(llama_model, config):
    plain, expected = _staggered(llama_model, **config)
    mixed, got = _staggered(llama_model, enable_mixed_chunk=True, **config)
    assert _ids(got) == _ids(expected)
    for rid, f in got.items():
        assert f["finish"] == {"type": "length", "length": len(expected[rid]["output_ids"])}
    # Each prefill after the first met decoding requests: mixed, they did not wait a step for it.
    assert sum(mixed.finished_at.values()) < sum(plain.finished_at.values())
    assert all(mixed.finished_at[rid] <= plain.finished_at[rid] for rid in got)
    assert mixed.sched.stats["generated_tokens"] == plain.sched.stats["generated_tokens"]


def test_seeded_sampling_draws_the_same_tokens_mixed(llama_model):
    """A seeded draw depends on (seed, position): a decode row inside a mixed batch must see the
    same position and penalty state as in its own decode step."""
    def sampling(i):
        return dict(temperature=0.9, top_k=40, top_p=0.95, sampling_seed=100 + i, frequency_penalty=0.3,
                    presence_penalty=0.2)

    plain, expected = _staggered(llama_model, sampling=sampling)
    mixed, got = _staggered(llama_model, enable_mixed_chunk=True, sampling=sampling)
    assert _ids(got) == _ids(expected)
    assert sum(mixed.finished_at.values()) < sum(plain.finished_at.values())


def test_a_logprob_request_runs_unmixed_and_keeps_its_logprobs(llama_model):
    h = Harness(llama_model, enable_mixed_chunk=True)
    ref = Harness(llama_model)
    prompts = random_prompts(h.runner.model_config.vocab_size, (12, 20), seed=32)
    for harness in (h, ref):
        harness.submit("lp", prompts[0], max_new_tokens=8, temperature=0, ignore_eos=True, return_logprob=True)
        harness.sched.step()
        harness.sched.step()
        harness.submit("plain", prompts[1], max_new_tokens=6, temperature=0, ignore_eos=True)
    got, expected = h.run(), ref.run()
    assert _ids(got) == _ids(expected)
    assert len(got["lp"]["meta"]["output_token_logprobs"]) == 8
    assert h.sched.forward_ct == ref.sched.forward_ct  # nothing was mixed: the same steps
    h.assert_conserved()


def test_tight_pool_skips_mixing_or_retracts_and_loses_nothing(llama_model):
    """A pool smaller than the work (optimistic admission): decode rows that find no slot after the
    prompts' are left out of that step; retraction still works; outputs equal the roomy run."""
    lens = (8,) * 8
    _, expected = _staggered(llama_model, arrivals_every=1, n_new=30, lens=lens)
    tight, got = _staggered(llama_model, arrivals_every=1, n_new=30, lens=lens, enable_mixed_chunk=True,
                            max_total_tokens=96, schedule_conservativeness=0.1)
    assert _ids(got) == _ids(expected)
    assert tight.sched.stats["num_retractions"] > 0
