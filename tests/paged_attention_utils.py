"""Paged KV layouts and a minimal runner for the CPU attention op tests."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

F32 = torch.float32


@dataclass
class Layout:
    """A pool whose requests own shuffled pages of `page_size` consecutive slots."""

    k: torch.Tensor
    v: torch.Tensor
    req_to_token: torch.Tensor
    rows: torch.Tensor
    seq_lens: torch.Tensor

    def slots(self, b: int) -> torch.Tensor:
        return self.req_to_token[self.rows[b], : self.seq_lens[b]].long()


def make_layout(seq_lens, page_size, kv_heads, dim, dtype=F32, seed=0) -> Layout:
    """Pages in random order, rows of `req_to_token` in random order, and every entry past a
    request's length pointing at a NaN-filled page: a read past seq_len poisons the output."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(n / page_size) for n in seq_lens]
    used = sum(pages)
    total = used + 2  # two NaN pages for the stale entries
    k = torch.randn((total + 1) * page_size, kv_heads, dim, generator=g)
    v = torch.randn((total + 1) * page_size, kv_heads, dim, generator=g)
    k[:page_size] = v[:page_size] = 0  # page 0: the dummy
    order = torch.randperm(total, generator=g) + 1
    nan_pages = order[used:]
    for p in nan_pages.tolist():
        k[p * page_size : (p + 1) * page_size] = v[p * page_size : (p + 1) * page_size] = float("nan")
    width = max(seq_lens) + 2 * page_size
    stale = (nan_pages[:, None] * page_size + torch.arange(page_size)).flatten().int()
    table = torch.zeros(len(seq_lens) + 3, width, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 3, generator=g)[: len(seq_lens)]
    start = 0
    for row, n, count in zip(rows.tolist(), seq_lens, pages):
        own = order[start : start + count]
        start += count
        slots = (own[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        table[row, :n] = slots.int()
        table[row, n:] = stale.repeat(math.ceil((width - n) / len(stale)))[: width - n]
    return Layout(k.to(dtype), v.to(dtype), table, rows, torch.tensor(seq_lens))


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    scaling: float


def make_backend_runner(page_size, kv_heads, head_dim, dtype, backend, size=4096):
    alloc = TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size)
    if page_size == 1:  # scattered, non-contiguous slots
        alloc.free_slots = alloc.free_slots[torch.randperm(len(alloc.free_slots))]
    else:
        alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages))]
    pool = MHATokenToKVPool(size, page_size, dtype, dtype, kv_heads, head_dim, 1)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=ReqToTokenPool(8, 1024), token_to_kv_pool=pool,
                             attn_backend=backend)
    return alloc, runner
