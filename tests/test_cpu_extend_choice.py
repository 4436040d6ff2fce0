"""Which CPU extend attention a model runs (`cpu_extend_uses_op`): the C++ op by default, torch's
SDPA for bf16 on CPUs with AMX tiles, either one by $SRT_CPU_EXTEND_ATTENTION; both agree."""

from __future__ import annotations

import pytest
import torch

from model_utils import assert_pool_conserved, greedy_run, make_runner, random_prompts
from srt.layers import cpu_fused_ops
from srt.layers.cpu_fused_ops import cpu_extend_uses_op


@pytest.mark.parametrize("amx", [True, False])
def test_auto_takes_sdpa_only_for_bf16_with_amx(monkeypatch, amx):
    monkeypatch.setattr(cpu_fused_ops, "cpu_has_amx", lambda: amx)
    assert cpu_extend_uses_op(torch.float32)
    assert cpu_extend_uses_op(torch.bfloat16) is (not amx)


def test_the_environment_forces_either_and_rejects_others(monkeypatch):
    monkeypatch.setattr(cpu_fused_ops, "cpu_has_amx", lambda: True)
    monkeypatch.setenv("SRT_CPU_EXTEND_ATTENTION", "op")
    assert cpu_extend_uses_op(torch.bfloat16)
    monkeypatch.setenv("SRT_CPU_EXTEND_ATTENTION", "sdpa")
    assert not cpu_extend_uses_op(torch.float32)
    monkeypatch.setenv("SRT_CPU_EXTEND_ATTENTION", "flash")
    with pytest.raises(ValueError, match="SRT_CPU_EXTEND_ATTENTION must be one of auto, op, sdpa, got 'flash'"):
        cpu_extend_uses_op(torch.float32)


def test_runner_with_sdpa_extend_keeps_the_decode_op_and_agrees(llama_model, monkeypatch):
    prompts = random_prompts(1000, [7, 40, 3], seed=4)
    monkeypatch.setenv("SRT_CPU_EXTEND_ATTENTION", "sdpa")
    sdpa = make_runner(llama_model)
    assert sdpa.attn_backend.paged_extend is None and sdpa.attn_backend.paged_decode is not None
    assert sdpa.cpu_decode_runner is not None
    monkeypatch.setenv("SRT_CPU_EXTEND_ATTENTION", "op")
    op = make_runner(llama_model)
    assert op.attn_backend.paged_extend is not None
    toks, first = greedy_run(sdpa, prompts, steps=6)
    ref_toks, ref_first = greedy_run(op, prompts, steps=6)
    torch.testing.assert_close(first, ref_first, rtol=1e-5, atol=1e-5)
    assert toks == ref_toks
    assert_pool_conserved(sdpa)
    assert_pool_conserved(op)
