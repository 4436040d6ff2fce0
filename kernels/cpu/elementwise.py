"""Fused CPU element-wise ops of a decoder layer (C++ in csrc/elementwise.cpp); the layers in
srt/layers call them through srt/layers/cpu_fused_ops.py when their input qualifies, and the torch
code they replace stays as the fallback and as the oracle of tests/test_cpu_elementwise.py.

    torch.ops.srt_cpu.rms_norm(x, residual | None, weight, eps) -> (out, new residual or empty)
    torch.ops.srt_cpu.silu_and_mul(x) -> silu(x[:, :d]) * x[:, d:]
    torch.ops.srt_cpu.rotary_embedding(positions, q, k, cos_cache, sin_cache) -> (q, k)
    torch.ops.srt_cpu.store_kv(k_buffer, v_buffer, loc, k, v) writes k and v [n, kv_heads, head_dim]
        into the pool's buffers at slots loc (the pool's index_copy_; any dtype, slots checked first)
    torch.ops.srt_cpu.argmax_rows(logits [rows, vocab]) -> [rows] int64 (csrc/sampling.cpp: the
        sampler's greedy rows; torch.argmax's answer, ties and NaN included)

Rows are 2-D with a contiguous last dim, fp32 or bf16; results round where the torch ops round.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu import build


@functools.lru_cache(maxsize=None)
def load_fused_ops() -> bool:
    """Whether `torch.ops.srt_cpu`'s fused ops are usable here (builds the library on first use)."""
    if not build.load_cpu_kernels():
        return False
    # Shapes for torch.compile's tracing (a compiled CPU decode calls these ops too).
    torch.library.register_fake("srt_cpu::rms_norm", _rms_norm_fake)
    torch.library.register_fake("srt_cpu::silu_and_mul", _silu_and_mul_fake)
    torch.library.register_fake("srt_cpu::rotary_embedding", _rotary_embedding_fake)
    torch.library.register_fake("srt_cpu::argmax_rows", _argmax_rows_fake)
    torch.library.register_fake("srt_cpu::store_kv", _store_kv_fake)
    return True


def _rms_norm_fake(x, residual, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else (0,))


def _silu_and_mul_fake(x):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


def _rotary_embedding_fake(positions, q, k, cos_cache, sin_cache):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _argmax_rows_fake(logits):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def _store_kv_fake(k_buffer, v_buffer, loc, k, v):
    return None
