"""The scheduler end to end on CUDA (skipped without it): the same outputs as on CPU, real CUDA
graphs equal to eager decode, and at most one synchronizing call per decode step as CUDA itself
counts them (`torch.cuda.set_sync_debug_mode`)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hot_path_utils import run_workload
from managers.schedule_batch import ScheduleBatch
from scheduler_utils import Harness
from test_cuda_graph_runner import _decode
from model_utils import make_runner, random_prompts
from srt.model_executor.cuda_graph_runner import CudaGraphRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("config", [dict(), dict(page_size=16, chunked_prefill_size=32)], ids=["page1", "page16"])
def test_scheduler_on_cuda_matches_cpu(llama_model, monkeypatch, config):
    monkeypatch.setenv("SRT_TEST_RETRACT_INTERVAL", "5")
    cpu = run_workload(Harness(llama_model, **config))
    harness = Harness(llama_model, device="cuda", attention_backend="torch_native", **config)
    assert harness.runner.graph_runner is not None and harness.runner.graph_runner.use_cuda_graph
    cuda = run_workload(harness)
    harness.assert_conserved()
    assert {k: v["output_ids"] for k, v in cuda.items()} == {k: v["output_ids"] for k, v in cpu.items()}


def test_captured_graphs_equal_eager_decode_for_every_batch_size(llama_model):
    runner = make_runner(llama_model, device="cuda", max_running_requests=16, disable_cuda_graph=True)
    graphs = CudaGraphRunner(runner, capture_bs=[1, 2, 4, 8])
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    for bs in range(1, 12):
        prompts = random_prompts(runner.model_config.vocab_size, [3 + (7 * i) % 23 for i in range(bs)], seed=bs)
        runner.graph_runner = None
        eager = _decode(runner, prompts, 5)
        runner.graph_runner = graphs
        graphed = _decode(runner, prompts, 5)
        assert graphed[0] == eager[0], f"bs={bs}"
        torch.testing.assert_close(graphed[1], eager[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_decode_step_synchronizes_at_most_once(llama_model, monkeypatch, graphs):
    harness = Harness(llama_model, device="cuda", attention_backend="torch_native", disable_cuda_graph=not graphs)
    counts = []
    real_run = harness.sched.run_batch

    def counted(batch: ScheduleBatch):
        if batch is not harness.sched.running_batch:
            return real_run(batch)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                real_run(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        counts.append([str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)])

    monkeypatch.setattr(harness.sched, "run_batch", counted)
    run_workload(harness)
    harness.assert_conserved()
    over = [c for c in counts if len(c) > 1]
    assert counts and not over, f"{len(over)} of {len(counts)} decode steps synced more than once: {over[:1]}"
