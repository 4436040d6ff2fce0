"""cache_unfinished_req / cache_finished_req against a small stand-in request.

`SimReq` satisfies `mem_cache.req_protocol.PrefixCacheReq`; `Harness` plays the scheduler's
part (match with the L-1 cap, lock, allocate, "compute" KV) so each test reads as a request's
life. The property tests import `SimReq` and `Harness` from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, List, Optional

import pytest
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.chunk_cache import ChunkCache
from mem_cache.memory_pool import ReqToTokenPool
from mem_cache.radix_cache import RadixCache, RadixKey
from mem_cache.radix_invariants import check_kv_conservation


@dataclass
class SimReq:
    """The fields of `PrefixCacheReq`, nothing else."""

    origin_input_ids: List[int]
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    extra_key: Optional[Hashable] = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0

    @property
    def all_ids(self) -> List[int]:
        return self.origin_input_ids + self.output_ids


class Harness:
    """Pools + cache + the live requests, with the scheduler-side steps a request goes through."""

    def __init__(self, page_size: int = 1, pool_tokens: int = 1024, kind: str = "radix", rows: int = 16, ctx: int = 512):
        P = page_size
        self.alloc = TokenToKVPoolAllocator(pool_tokens) if P == 1 else PagedTokenToKVPoolAllocator(pool_tokens, P)
        self.req_pool = ReqToTokenPool(rows, ctx)
        if kind == "chunk":
            self.cache = ChunkCache(self.req_pool, self.alloc, page_size=P)
        else:
            self.cache = RadixCache(self.req_pool, self.alloc, page_size=P, disable=(kind == "disabled"))
        self.live: List[SimReq] = []

    def admit(self, prompt: List[int], extra_key: Optional[Hashable] = None) -> SimReq:
        """Match at most len(prompt) - 1 tokens (one is always recomputed), lock, take a row."""
        req = SimReq(origin_input_ids=list(prompt), extra_key=extra_key)
        match = self.cache.match_prefix(RadixKey(req.origin_input_ids[: len(prompt) - 1], extra_key))
        self.cache.inc_lock_ref(match.last_node)
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        req.cache_protected_len = req.kv_committed_len = req.kv_allocated_len = len(match.device_indices)
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        self.req_pool.write(req.req_pool_idx, 0, match.device_indices)
        req.fill_ids = req.all_ids[: req.kv_committed_len]
        self.live.append(req)
        return req

    def extend(self, req: SimReq, n: int) -> bool:
        """Allocate slots for the next `n` positions and mark their KV computed (evicting if short).
        Returns False (nothing changed) when the pool cannot supply them."""
        a = req.kv_allocated_len
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last_loc = [int(row[a - 1])] if a else [0]
        slots = self.alloc.alloc_extend([a], [a + n], last_loc)
        if slots is None:
            self.cache.evict(n + self.cache.page_size)
            slots = self.alloc.alloc_extend([a], [a + n], last_loc)
            if slots is None:
                return False
        self.req_pool.write(req.req_pool_idx, a, slots)
        req.kv_allocated_len += n
        req.kv_committed_len += n
        req.fill_ids = req.all_ids[: req.kv_committed_len]
        return True

    def run(self, prompt: List[int], outputs: List[int], extra_key: Optional[Hashable] = None) -> int:
        """A whole request: prefill, sample `outputs` (each decode computes the previous token's
        KV), finish. Returns its cached_tokens."""
        req = self.admit(prompt, extra_key)
        cached = req.cache_protected_len
        assert self.extend(req, len(prompt) - cached)
        for i, tok in enumerate(outputs):
            if i:
                assert self.extend(req, 1)
            req.output_ids.append(tok)
        self.finish(req)
        return cached

    def finish(self, req: SimReq) -> None:
        self.cache.cache_finished_req(req)
        self.live.remove(req)

    def check(self) -> None:
        self.cache.check_invariants()
        check_kv_conservation(self.cache, self.alloc, self.req_pool, self.live)


def row_of(h: Harness, req: SimReq, stop: int) -> List[int]:
    return h.req_pool.req_to_token[req.req_pool_idx, :stop].tolist()


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


# -- cache_finished_req ---------------------------------------------------------------------------


def test_finished_req_inserts_prompt_and_output_up_to_committed_length():
    h = Harness()
    req = h.admit(PROMPT)
    h.extend(req, len(PROMPT))
    req.output_ids = [50]
    h.extend(req, 1)
    req.output_ids.append(51)  # sampled last: no KV
    slots = row_of(h, req, req.kv_committed_len)
    h.finish(req)
    assert h.cache.total_size() == len(PROMPT) + 1
    assert h.cache.match_prefix(PROMPT + [50, 51]).device_indices.tolist() == slots
    assert req.req_pool_idx is None and h.req_pool.available_size() == 16
    h.check()


def test_finished_req_frees_exactly_its_duplicates():
    h = Harness(pool_tokens=64)
    first, second = h.admit(PROMPT), h.admit(PROMPT)  # both miss: neither is cached yet
    h.extend(first, len(PROMPT))
    h.extend(second, len(PROMPT))
    h.finish(first)
    free_before = h.alloc.available_size()
    tree_slots = h.cache.match_prefix(PROMPT).device_indices.tolist()
    h.finish(second)
    assert h.alloc.available_size() == free_before + len(PROMPT)
    assert h.cache.match_prefix(PROMPT).device_indices.tolist() == tree_slots
    h.check()


def test_finished_req_keeps_what_extends_the_tree_and_frees_only_the_overlap():
    h = Harness(pool_tokens=64)
    h.run(PROMPT[:6], [1])
    req = h.admit(PROMPT)  # matches 6 of the first request's 6 committed tokens
    assert req.cache_protected_len == 6
    h.extend(req, len(PROMPT) - 6)
    free_before = h.alloc.available_size()
    h.finish(req)
    assert h.alloc.available_size() == free_before  # nothing duplicated, nothing beyond committed
    assert h.cache.total_size() == len(PROMPT)
    h.check()


@pytest.mark.parametrize("page_size", [2, 4])
def test_finished_req_frees_the_unaligned_tail_pages(page_size):
    h = Harness(page_size=page_size, pool_tokens=64)
    req = h.admit(PROMPT)  # 10 tokens: 2 or 2.5 pages
    h.extend(req, len(PROMPT))
    h.finish(req)
    aligned = len(PROMPT) - len(PROMPT) % page_size
    assert h.cache.total_size() == aligned
    assert h.alloc.available_size() == 64 - aligned
    h.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_exact_repeat_reports_all_but_one_token_cached(page_size):
    h = Harness(page_size=page_size)
    h.run(PROMPT, [50, 51, 52])
    cached = h.run(PROMPT, [50])
    L = len(PROMPT)
    assert cached == (L - 1) - (L - 1) % page_size
    h.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_extension_reuses_the_whole_previous_conversation(page_size):
    h = Harness(page_size=page_size)
    reply = [50, 51, 52, 53, 54]
    h.run(PROMPT, reply)
    history = PROMPT + reply  # the last reply token was never run through the model
    cached = h.run(history + [60, 61, 62], [70])
    expected = len(history) - 1
    assert cached == expected - expected % page_size
    h.check()


def test_finishing_releases_the_lock_so_everything_becomes_evictable():
    h = Harness(pool_tokens=64)
    h.run(PROMPT, [1, 2])
    req = h.admit(PROMPT + [1, 2, 3])
    assert h.cache.protected_size() == req.cache_protected_len > 0
    h.extend(req, 13 - req.cache_protected_len)
    h.finish(req)
    assert h.cache.protected_size() == 0
    h.cache.evict(10**6)
    assert h.alloc.available_size() == 64
    h.check()


# -- cache_unfinished_req (chunked prefill) ------------------------------------------------------


def test_unfinished_req_shares_the_chunk_and_moves_the_lock_down():
    h = Harness()
    req = h.admit(PROMPT)
    h.extend(req, 4)
    h.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 4 and h.cache.protected_size() == 4
    assert req.last_node.key.token_ids == PROMPT[:4] and req.last_node.lock_ref == 1
    assert req.prefix_indices.tolist() == row_of(h, req, 4)
    h.check()
    h.extend(req, 6)
    h.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 10 and h.cache.protected_size() == 10
    assert h.cache.match_prefix(PROMPT).last_node is req.last_node
    h.check()
    h.finish(req)
    assert h.cache.protected_size() == 0
    h.check()


def test_unfinished_req_rewrites_the_row_to_the_trees_slots_and_frees_duplicates():
    h = Harness(pool_tokens=64)
    other = h.admit(PROMPT)
    req = h.admit(PROMPT)
    h.extend(other, len(PROMPT))
    h.extend(req, 6)
    h.finish(other)  # the tree now owns PROMPT with other's slots
    tree_slots = h.cache.match_prefix(PROMPT).device_indices.tolist()
    free_before = h.alloc.available_size()
    h.cache.cache_unfinished_req(req)
    assert row_of(h, req, 6) == tree_slots[:6]
    assert req.prefix_indices.tolist() == tree_slots[:6]
    assert h.alloc.available_size() == free_before + 6
    h.check()


@pytest.mark.parametrize("page_size", [2, 4])
def test_unfinished_req_keeps_the_unaligned_tail_private_and_continues_its_page(page_size):
    h = Harness(page_size=page_size, pool_tokens=64)
    req = h.admit(PROMPT)
    h.extend(req, 5)
    tail_slot = row_of(h, req, 5)[4]
    h.cache.cache_unfinished_req(req)
    aligned = 5 - 5 % page_size
    assert req.cache_protected_len == aligned and h.cache.total_size() == aligned
    assert req.prefix_indices.tolist() == row_of(h, req, 5) and row_of(h, req, 5)[4] == tail_slot
    h.check()
    h.extend(req, 5)  # continues the partial page
    assert row_of(h, req, 6)[5] == tail_slot + 1
    h.cache.cache_unfinished_req(req)
    h.check()
    h.finish(req)
    h.check()


# -- never-share caches -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chunk", "disabled"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_never_share_caches_free_everything_and_never_hit(kind, page_size):
    h = Harness(page_size=page_size, pool_tokens=64, kind=kind)
    assert h.run(PROMPT, [1, 2, 3]) == 0
    req = h.admit(PROMPT)
    assert req.cache_protected_len == 0
    h.extend(req, 4)
    h.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 0 and req.prefix_indices.tolist() == row_of(h, req, 4)
    h.check()
    h.extend(req, 6)
    h.finish(req)
    assert h.alloc.available_size() == 64 and h.req_pool.available_size() == 16
    h.check()


def test_conservation_check_catches_a_leaked_slot():
    h = Harness(pool_tokens=64)
    h.run(PROMPT, [1])
    h.alloc.alloc(1)  # taken by nobody we know of
    with pytest.raises(AssertionError, match="leaked"):
        h.check()


def test_conservation_check_catches_a_slot_owned_twice():
    h = Harness(pool_tokens=64)
    h.run(PROMPT, [1])
    req = h.admit([1, 2, 3])
    h.extend(req, 1)
    free_slot = h.alloc.free_slots[:1]
    h.req_pool.write(req.req_pool_idx, 0, free_slot)  # counts unchanged, one slot owned twice
    with pytest.raises(AssertionError, match="owned by both free list and request"):
        h.check()
