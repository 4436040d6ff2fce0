"""The prefix-cache interface shared by `RadixCache` and `ChunkCache` (`--disable-radix-cache`)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import torch

from mem_cache.radix_tree_node import RadixKey
from mem_cache.req_protocol import PrefixCacheReq

KeyLike = Union[RadixKey, Sequence[int]]


@dataclass(frozen=True)
class MatchResult:
    """Result of `match_prefix`.

    `device_indices`: int64 KV slots of the matched prefix (a multiple of the page size long).
    They stay valid only while `last_node` is locked (`inc_lock_ref`): an unlocked prefix may be
    evicted and its slots handed to another request.
    `last_node`: deepest node of the match (the root when nothing matched); lock it to protect
    the whole path.
    """

    device_indices: torch.Tensor
    last_node: Any


class BasePrefixCache(abc.ABC):
    """Who may reuse which KV slots.

    Ownership (ARCHITECTURE 4.1): every KV slot belongs to exactly one of the allocator's free
    list, one tree node's `value`, or one live request's private range
    `req_to_token[row, cache_protected_len:kv_allocated_len]`. Conservation:
    `allocator.available_size() + evictable_size() + protected_size() + private slots of live
    requests (each request's private count rounded up to whole pages) == pool size`.

    Tree tokens are either *evictable* (no lock on the node or below it) or *protected*
    (`lock_ref > 0`); `inc_lock_ref` / `dec_lock_ref` move them between the two. A cache that
    never shares (`ChunkCache`, `RadixCache(disable=True)`) holds no tokens: both sizes are 0.
    """

    disable: bool = False
    page_size: int = 1
    device: Union[str, torch.device] = "cpu"  # where returned slot tensors live (the allocator's)

    @abc.abstractmethod
    def match_prefix(self, key: KeyLike) -> MatchResult:
        """Longest cached prefix of `key` (page-aligned); may split a node; touches the path."""

    @abc.abstractmethod
    def insert(self, key: KeyLike, value: Optional[torch.Tensor] = None) -> int:
        """Store `key -> value` and return how many leading tokens were already present.

        The tree takes ownership of `value[prefix:len]` (page-aligned part only); the caller
        still owns `value[:prefix]` (duplicates of slots the tree already had: free them) and
        any unaligned tail. The tree may keep a view of `value` and a reference to the key's
        token list: the caller must not write into either afterwards (appending to the list is
        fine), and must never pass a view of `req_to_token` it will rewrite (RadixCache copies
        those).
        """

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked tokens (fewer if not enough are evictable); returns
        how many were freed (may overshoot by one node)."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Lock the path root..node; returns the change of `evictable_size()`."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change of `evictable_size()`."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens in locked nodes."""

    def total_size(self) -> int:
        """Tokens held by the cache."""
        return self.evictable_size() + self.protected_size()

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every cached prefix (only while no request holds a lock)."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """After a prefill chunk: share what has KV, keep the request's lock and row consistent."""

    @abc.abstractmethod
    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """On finish: keep what may be reused, free the rest, unlock, free the request's row."""

    @abc.abstractmethod
    def check_invariants(self) -> None:
        """Raise `AssertionError` (with what is wrong) if internal accounting is inconsistent."""

    @abc.abstractmethod
    def pretty_print(self) -> str:
        """Human-readable dump of the cache (also logged at INFO)."""

    # -- helpers for caches that never share -------------------------------------------------

    def _row_slots(self, req: PrefixCacheReq, start: int, stop: int) -> torch.Tensor:
        """int64 copy of `req_to_token[req.req_pool_idx, start:stop]`."""
        if req.req_pool_idx is None:
            raise AssertionError("request has no req_to_token row (already finished or retracted?)")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return row[start:stop].to(torch.int64)

    def _release_row(self, req: PrefixCacheReq) -> None:
        """Free the request's row and clear its KV fields: it owns nothing afterwards."""
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = empty_indices(self.device)
        req.cache_protected_len = 0
        req.kv_committed_len = 0
        req.kv_allocated_len = 0

    def _finish_unshared(self, req: PrefixCacheReq) -> None:
        """Free every private slot `[cache_protected_len, kv_allocated_len)` and the row."""
        slots = self._row_slots(req, req.cache_protected_len, req.kv_allocated_len)
        self.token_to_kv_pool_allocator.free_aligned(slots)  # the span starts on a page
        self._release_row(req)

    def _keep_unshared(self, req: PrefixCacheReq) -> None:
        """Nothing is shared: the committed span stays private and becomes the prefix."""
        req.prefix_indices = self._row_slots(req, 0, req.kv_committed_len)


def as_radix_key(key: KeyLike) -> RadixKey:
    """Accept a `RadixKey` or a plain sequence of ints (default namespace; the key is fixed to
    the ids the sequence holds now)."""
    return key if isinstance(key, RadixKey) else RadixKey(key, fixed=True)


def empty_indices(device: Union[str, torch.device] = "cpu") -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


__all__: List[str] = ["BasePrefixCache", "MatchResult", "KeyLike", "as_radix_key", "empty_indices"]
