"""fp8 KV storage: close to fp32 KV, and half the bytes per token of bf16."""

from __future__ import annotations

import pytest
import torch

from mem_cache.memory_pool import MHATokenToKVPool
from model_utils import assert_pool_conserved, make_runner, random_prompts
from srt.model_executor.static_batch import StaticBatch

# fp8 keeps 3 (e4m3) or 2 (e5m2) mantissa bits: per-element error up to 6% / 12%; after
# attention averaging, logits of the tiny random model move by a few percent of their range.
TOLERANCE = {"fp8_e4m3": 0.08, "fp8_e5m2": 0.15}


def _logits(path, kv_cache_dtype, prompts):
    runner = make_runner(path, kv_cache_dtype=kv_cache_dtype)
    batch = StaticBatch(runner, len(prompts))
    batch.extend([p[:-4] for p in prompts])
    out = batch.extend([p[-4:] for p in prompts]).next_token_logits  # reads the stored prefix
    batch.release()
    assert_pool_conserved(runner)
    return out


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_logits_close_to_fp32(llama_model, kv_dtype):
    prompts = random_prompts(500, (24, 40), seed=5)
    ref = _logits(llama_model, "fp32", prompts)
    got = _logits(llama_model, kv_dtype, prompts)
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < TOLERANCE[kv_dtype], f"{kv_dtype}: relative logit error {rel:.3f}"
    assert rel > 0, "fp8 storage should not be lossless: is it really stored in fp8?"


def test_fp8_halves_memory_per_token_vs_bf16():
    bf16 = MHATokenToKVPool.cell_size_bytes(8, 128, 32, torch.bfloat16)
    fp8 = MHATokenToKVPool.cell_size_bytes(8, 128, 32, torch.float8_e4m3fn)
    assert fp8 * 2 == bf16
    pool = MHATokenToKVPool(64, 1, torch.float32, torch.float8_e4m3fn, 2, 16, 2)
    assert pool.k_buffer[0].dtype == torch.float8_e4m3fn
    assert pool.k_buffer[0].element_size() == 1


def test_fp8_store_saturates_instead_of_nan():
    pool = MHATokenToKVPool(8, 1, torch.float32, torch.float8_e4m3fn, 1, 4, 1)
    big = torch.full((1, 1, 4), 1e6)
    pool.set_kv_buffer(0, torch.tensor([1]), big, big)
    assert torch.isfinite(pool.k_buffer[0][1].float()).all()
