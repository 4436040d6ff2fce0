"""The request fields the prefix caches read and write (a `typing.Protocol`).

The scheduler's `Req` satisfies it; tests use a small dataclass. Index-range map of a request's
row `r = req_to_token[req_pool_idx]` (P = page size):

    [0, cache_protected_len)                  slots owned by the tree, kept alive by the lock on
                                              `last_node` (a multiple of P)
    [cache_protected_len, kv_allocated_len)   the request's private slots (its pages, when P > 1:
                                              ceil((kv_allocated_len - cache_protected_len) / P)
                                              whole pages, the last one possibly part-used)
    [0, kv_committed_len)                     positions whose KV has been computed
                                              (kv_committed_len <= kv_allocated_len)
"""

from __future__ import annotations

from typing import Any, Hashable, List, Optional, Protocol

import torch


class PrefixCacheReq(Protocol):
    """What `cache_unfinished_req` / `cache_finished_req` need from a request."""

    origin_input_ids: List[int]
    """The prompt token ids."""
    output_ids: List[int]
    """Generated token ids so far (the last one has no KV yet)."""
    fill_ids: List[int]
    """Tokens this request is prefilling up to now (prompt chunk, or prompt + outputs)."""
    req_pool_idx: Optional[int]
    """Row of `req_to_token`; None once the row is freed."""
    prefix_indices: torch.Tensor
    """int64 slots of `[0, len(prefix_indices))`: the matched prefix, or after a chunk the whole
    committed span (tree-owned part first, then private tail)."""
    last_node: Any
    """Deepest tree node of the tree-owned span; this request holds one lock on it."""
    cache_protected_len: int
    """Leading positions of the row owned by the tree (protected by the lock on `last_node`)."""
    extra_key: Optional[Hashable]
    """Cache namespace (cache salt, LoRA id); None for the default namespace."""
    kv_committed_len: int
    """Positions `[0, kv_committed_len)` of the row have KV computed."""
    kv_allocated_len: int
    """Positions `[0, kv_allocated_len)` of the row have a slot (committed or not)."""
