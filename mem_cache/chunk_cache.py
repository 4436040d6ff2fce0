"""`ChunkCache`: the prefix cache of `--disable-radix-cache`, which never shares KV.

Each request keeps its own slots for its whole life (chunked prefill continues from the
request's own committed slots) and frees them all when it finishes.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from mem_cache.base_prefix_cache import BasePrefixCache, KeyLike, MatchResult, empty_indices
from mem_cache.req_protocol import PrefixCacheReq

logger = logging.getLogger(__name__)


class ChunkCache(BasePrefixCache):
    """Never shares: `match_prefix` always misses (last_node None), `insert` stores nothing and
    returns 0, locks are no-ops, `evict` frees nothing and all sizes are 0.

    Because it holds no tokens, every slot of a live request is private
    (`cache_protected_len` stays 0) and conservation reads
    `allocator.available_size() + private slots of live requests == pool size`.
    """

    disable = True

    def __init__(self, req_to_token_pool: Any, token_to_kv_pool_allocator: Any, page_size: int = 1):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")

    def match_prefix(self, key: KeyLike) -> MatchResult:
        return MatchResult(empty_indices(self.device), None)

    def insert(self, key: KeyLike, value: Optional[torch.Tensor] = None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """`prefix_indices` becomes the request's own committed slots; nothing changes owner."""
        self._keep_unshared(req)

    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """Free the private slots `[cache_protected_len, kv_allocated_len)` and the row."""
        self._finish_unshared(req)

    def check_invariants(self) -> None:
        pass

    def pretty_print(self) -> str:
        text = "ChunkCache (never shares; holds no tokens)"
        logger.info(text)
        return text
