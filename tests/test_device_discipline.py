"""The GPU path kept honest on CPU.

* Every hot-path tensor names its device: the scheduler runs end to end with
  `torch.set_default_device("meta")` while the model and pools stay on CPU, so a tensor built
  without `device=` lands on `meta` and the step fails. Outputs must equal the normal run.
* At most one device-to-host sync per decode step (sampled ids and logprobs in one transfer).
"""

from __future__ import annotations

import pytest

from hot_path_utils import SyncCounter, default_device, run_workload
from managers.schedule_batch import ScheduleBatch
from scheduler_utils import Harness

CONFIGS = [
    dict(),
    dict(page_size=16, chunked_prefill_size=32),
    dict(chunked_prefill_size=16, max_total_tokens=400),  # tight pool: eviction and retraction
]


def _ids(config):
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


def _harness(model, config, monkeypatch=None):
    config = dict(config)
    return Harness(model, max_total_tokens=config.pop("max_total_tokens", 4096), **config)


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_scheduler_under_meta_default_device_matches_normal_run(llama_model, monkeypatch, config):
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "5")
    plain = _harness(llama_model, config)
    expected = run_workload(plain)
    plain.assert_conserved()
    assert plain.sched.stats["num_retractions"] > 0, "the workload must exercise retraction"

    strict = _harness(llama_model, config)
    with default_device("meta"):
        got = run_workload(strict)
        strict.assert_conserved()
    assert set(got) == set(expected)
    for rid in expected:
        assert got[rid]["output_ids"] == expected[rid]["output_ids"], rid
        assert got[rid]["finish"] == expected[rid]["finish"], rid
        assert got[rid]["meta"] == expected[rid]["meta"], rid
    assert expected["aborted"]["finish"]["type"] == "abort"
    assert len(expected["logprobs"]["meta"]["output_top_logprobs"][0]) == 3


@pytest.mark.parametrize("config", CONFIGS[:2], ids=_ids)
def test_at_most_one_host_sync_per_decode_step(llama_model, monkeypatch, config):
    harness = _harness(llama_model, config)
    counts = []
    real_run = harness.sched.run_batch

    def counted(batch: ScheduleBatch):
        if batch is not harness.sched.running_batch:
            return real_run(batch)
        with SyncCounter() as counter:
            real_run(batch)
        counts.append(counter.calls)

    monkeypatch.setattr(harness.sched, "run_batch", counted)
    run_workload(harness)
    harness.assert_conserved()
    assert len(counts) > 10
    over = [c for c in counts if len(c) > 1]
    assert not over, f"{len(over)} of {len(counts)} decode steps synced more than once; first: {over[0]}"
