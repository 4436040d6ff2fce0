"""Paged decode and extend attention that read the KV pool in place: when the C++ ops serve a backend.

`torch.ops.srt_cpu.paged_decode_attention(q, k_buffer, v_buffer, req_to_token,
req_pool_indices, seq_lens, scale, share_prefixes=True, bf16_dot=True)`: q `[bs, heads, head_dim]`
attends, per request b, to the KV slots `req_to_token[req_pool_indices[b], :seq_lens[b]]`; returns
`[bs, heads, head_dim]`. With `share_prefixes`, requests whose rows hold the same slots over a
split of keys (a prefix the radix cache shares) read those K/V rows once together; each request's
result is bit for bit what it is alone. With `bf16_dot`, bf16 q and KV on a CPU with AVX512-BF16
are scored with bf16 dot products on the K rows in place (csrc/bf16_dot_tiles.h) instead of
fp32 copies of them; False keeps the fp32 tiles (for side-by-side measurements).

`torch.ops.srt_cpu.paged_extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
prefix_lens, extend_lens, scale)`: q `[tokens, heads, head_dim]` holds each request's new tokens,
requests back to back; token t of request b (position prefix_lens[b] + t) attends causally to the
slots `req_to_token[req_pool_indices[b], :prefix_lens[b] + t + 1]`, its cached prefix and the new
tokens up to itself, whose K/V are in the pool already. Returns `[tokens, heads, head_dim]`.

Slot indices make both page-size agnostic; fp32 or bf16 q and KV, fp32 accumulation.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from kernels.cpu import build

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode_op(device: "torch.device | str", q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Optional[Callable]:
    """The C++ decode op when it can serve this pool: a CPU device, q and KV storage in fp32 or
    bf16 (fp8 KV keeps the torch path), and the library builds here. Otherwise None."""
    return torch.ops.srt_cpu.paged_decode_attention if _serves(device, q_dtype, kv_dtype) else None


def paged_extend_op(device: "torch.device | str", q_dtype: torch.dtype, kv_dtype: torch.dtype) -> Optional[Callable]:
    """The C++ extend op, under the same conditions as `paged_decode_op`. Otherwise None."""
    return torch.ops.srt_cpu.paged_extend_attention if _serves(device, q_dtype, kv_dtype) else None


def _serves(device: "torch.device | str", q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    if torch.device(device).type != "cpu" or q_dtype not in SUPPORTED_DTYPES or kv_dtype not in SUPPORTED_DTYPES:
        return False
    return _load()


@functools.lru_cache(maxsize=None)
def _load() -> bool:
    if not build.load_cpu_kernels():
        return False
    # Shapes for torch.compile's tracing (the CPU decode may run under a compiled forward).
    torch.library.register_fake("srt_cpu::paged_decode_attention", _paged_decode_attention_fake)
    torch.library.register_fake("srt_cpu::paged_extend_attention", _paged_extend_attention_fake)
    return True


def _paged_decode_attention_fake(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, scale,
                                 share_prefixes=True, bf16_dot=True):
    return q.new_empty(q.shape)


def _paged_extend_attention_fake(q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens,
                                 scale):
    return q.new_empty(q.shape)
