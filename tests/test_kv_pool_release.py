"""A flushed CPU KV pool gives its touched pages back to the OS (issue 15, item 14: scheduler RSS
grew with every slot the radix cache ever filled and did not come back after /flush_cache)."""

from __future__ import annotations

import psutil
import torch

from mem_cache.memory_pool import MHATokenToKVPool


def _rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def test_release_host_pages_returns_touched_pages_and_keeps_the_dummy_slot_zero():
    pool = MHATokenToKVPool(size=400_000, page_size=1, dtype=torch.float32, store_dtype=torch.float32,
                            head_num=2, head_dim=32, layer_num=2, device="cpu")  # 4 x 102 MB
    before = _rss_mib()
    for buf in pool.k_buffer + pool.v_buffer:
        buf[1:].fill_(1.0)  # what a long soak does to the pool, slot by slot
    del buf  # the loop variable would keep the last buffer alive
    touched = _rss_mib()
    assert touched - before > 300
    assert pool.release_host_pages() is True
    released = _rss_mib()
    assert touched - released > 300, (before, touched, released)
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (400_001, 2, 32) and torch.count_nonzero(buf[:1]) == 0
    loc = torch.tensor([5, 9])
    pool.set_kv_buffer(0, loc, torch.ones(2, 2, 32), torch.full((2, 2, 32), 2.0))
    assert torch.equal(pool.get_value_buffer(0)[loc], torch.full((2, 2, 32), 2.0))
