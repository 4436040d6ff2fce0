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


def test_release_after_malloc_tuning_returns_the_pages_although_the_heap_has_room():
    """With the raised mmap/trim thresholds (as in a CPU model process) and free heap space left by
    earlier frees, a pool buffer from malloc would be carved from the heap and freeing it would
    return nothing (a fresh-clone CI run caught it); the pool's own mappings are unmapped. Runs in
    a fresh interpreter: mallopt is process-wide."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import psutil, torch
from srt.utils.host_allocator import tune_host_allocator
from mem_cache.memory_pool import MHATokenToKVPool
assert tune_host_allocator()
rss = lambda: psutil.Process().memory_info().rss / 2**20
big = [torch.ones(3_000_000, device="cpu") for _ in range(60)]  # 12 MB blocks: heap, not mmap
del big  # ~720 MB of free heap kept by the 1 GiB trim threshold
pool = MHATokenToKVPool(size=200_000, page_size=1, dtype=torch.float32, store_dtype=torch.float32,
                        head_num=2, head_dim=32, layer_num=2, device="cpu")  # 4 x 51 MB
for buf in pool.k_buffer + pool.v_buffer:
    buf[1:].fill_(1.0)
del buf
touched = rss()
assert pool.release_host_pages() is True
print(touched - rss())
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip()) > 150
