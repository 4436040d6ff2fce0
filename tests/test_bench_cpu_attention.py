"""scripts/bench_cpu_attention.py times the C++ extend op against the torch path on one pool and
checks they agree; a small case runs here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_cpu_attention  # noqa: E402
from kernels.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402


def test_parse_case_reads_batch_extend_and_prefix():
    assert bench_cpu_attention.parse_case("15x64@1024") == (15, 64, 1024)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_small_case_times_both_paths_and_they_agree(dtype, tol):
    backends = {"torch": TorchNativeAttnBackend(), "op": TorchNativeAttnBackend("cpu", dtype, dtype)}
    assert backends["op"].paged_extend is not None
    times, flops, diff = bench_cpu_attention.time_backends(backends, (3, 17, 40), 4, 2, 32, dtype, reps=2)
    assert set(times) == {"torch", "op"} and all(t > 0 for t in times.values())
    assert flops == 4 * 3 * 4 * 32 * 17 * (40 + 9)
    assert diff < tol
