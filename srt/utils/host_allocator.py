"""Keep the CPU forward's large activations in the process heap between steps (glibc malloc).

glibc serves blocks over M_MMAP_THRESHOLD (128 KiB, raised on the fly up to 32 MiB) with fresh
mmaps and gives the heap's top back to the OS past M_TRIM_THRESHOLD. A CPU prefill allocates and
frees tens of MiB per op (a 2,048-token chunk's gate/up output of SmolLM2 is 25 MiB), so every
such tensor came back as new zeroed pages and paid a page fault per 4 KiB: SmolLM2's fp32 prefill
spent ~20% of its time there. Raising both thresholds once per process keeps those blocks for
reuse, the effect SGLang's CPU guide gets by preloading tcmalloc or jemalloc. The cost is RSS:
the heap keeps its high-water mark (one forward's activations) until `trim_host_heap` trims
it, which a cache flush does. The CPU KV pool has anonymous mappings of its own
(mem_cache/memory_pool.py), unmapped on a flush.

A MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ / MALLOC_TOP_PAD_ in the environment, a
non-glibc libc or SRT_CPU_MALLOC_TUNING=0 leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

import torch

from srt.environ import envs

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this parameter on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20
USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.lru_cache(maxsize=None)
def _libc():
    """glibc through ctypes, or None on another libc (musl, macOS): nothing to tune there."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def trim_host_heap() -> bool:
    """Give the host memory that only caches still hold back to the OS; True when malloc released
    some. First torch's pinned-block cache (CUDA builds; torch's plain CPU allocator caches nothing,
    it frees straight to malloc), then the heap: glibc `malloc_trim(0)` returns the free pages of
    every arena, which the raised thresholds otherwise keep resident. The scheduler calls this after
    every cache flush, once the CPU KV pool has unmapped its buffers."""
    empty_pinned = getattr(torch._C, "_host_emptyCache", None)  # torch's own name for it (2.5+)
    if empty_pinned is not None and torch.cuda.is_initialized():  # pinned blocks exist only once CUDA is up
        empty_pinned()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.lru_cache(maxsize=None)
def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once; True when applied."""
    if not envs.CPU_MALLOC_TUNING.get() or any(v in os.environ for v in USER_VARS):
        return False
    libc = _libc()
    if libc is None:
        return False
    applied = all(libc.mallopt(param, value) == 1 for param, value in
                  ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if applied:
        logger.info("glibc malloc keeps blocks up to %d MiB in the heap for reuse (SRT_CPU_MALLOC_TUNING=0 "
                    "turns this off).", MMAP_THRESHOLD >> 20)
    return applied
