"""KV slot allocators: shortage returns None, slot 0 is never handed out, pages fill first."""

from __future__ import annotations

import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import ReqToTokenPool


def test_token_allocator_shortage_and_free():
    a = TokenToKVPoolAllocator(10)
    x = a.alloc(7)
    assert 0 not in x.tolist() and len(set(x.tolist())) == 7
    assert a.alloc(4) is None and a.available_size() == 3
    a.free(x)
    assert a.available_size() == 10


def test_paged_alloc_extend_fills_partial_page_first():
    a = PagedTokenToKVPoolAllocator(64, 4)
    first = a.alloc_extend([0], [6], [0])  # pages p, q: 4 + 2 slots
    assert len(first) == 6 and int(first[4]) % 4 == 0 and int(first[5]) == int(first[4]) + 1
    more = a.alloc_extend([6], [11], [int(first[-1])])  # 2 in the partial page, then a new page
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert int(more[2]) % 4 == 0
    assert a.available_size() == 64 - 12
    assert all(int(s) >= 4 for s in torch.cat([first, more]))  # page 0 never handed out


def test_paged_alloc_decode_takes_page_only_at_boundary():
    a = PagedTokenToKVPoolAllocator(32, 4)
    before = a.available_size()
    out = a.alloc_decode(torch.tensor([3, 5]), torch.tensor([9, 15]))  # positions 2 and 4
    assert int(out[0]) == 10 and int(out[1]) % 4 == 0
    assert a.available_size() == before - 4


def test_paged_shortage_returns_none_and_free_returns_pages():
    a = PagedTokenToKVPoolAllocator(16, 4)
    x = a.alloc(16)
    assert a.alloc(4) is None and a.alloc_extend([0], [1], [0]) is None
    a.free(x[:5])  # slots of two pages
    assert a.available_size() == 8


def test_req_to_token_pool_slots():
    p = ReqToTokenPool(3, 16)
    rows = p.alloc(3)
    assert sorted(rows) == [0, 1, 2] and p.alloc(1) is None
    p.free(rows[0])
    assert p.available_size() == 1
