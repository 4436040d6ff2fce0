"""Radix-tree prefix cache: the longest cached prefix of a request is KV it does not recompute.

Match and insert compare whole spans (`bytes ==` on packed int32 keys, bisection to find a
divergence point), never token by token in Python; eviction pops a lazy heap of unlocked
leaves kept up to date incrementally. Semantics: ARCHITECTURE.md section 4.2.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, List, Optional, Tuple

import torch

from mem_cache.base_prefix_cache import (
    BasePrefixCache,
    KeyLike,
    MatchResult,
    as_radix_key,
    empty_indices,
)
from mem_cache.evict_heap import EvictHeap
from mem_cache.radix_invariants import check_radix_invariants
from mem_cache.radix_tree_node import RadixKey, TreeNode, common_prefix_len
from mem_cache.req_protocol import PrefixCacheReq

logger = logging.getLogger(__name__)

_W = 4  # bytes per packed token id (RadixKey packs int32)

__all__ = ["RadixCache", "RadixKey", "TreeNode", "MatchResult"]


class RadixCache(BasePrefixCache):
    """Token-sequence radix tree whose node values are KV slot indices.

    - Children are keyed by the first token (page_size 1) or first page (page_size P > 1) of
      their key, prefixed by the namespace when `extra_key` is not None, so namespaces never
      share nodes. With P > 1 every key is a whole number of pages: match and insert drop the
      unaligned tail of a key.
    - The root holds no tokens and is permanently locked (`lock_ref == 1`).
    - A lock on a node protects the path to the root; unlocked leaves are evicted least
      recently used first (`eviction_policy="lfu"`: fewest hits, then least recent).
      Access times come from a logical clock that ticks once per match / insert.
    - `disable=True`: never shares, through the same interface (like `ChunkCache`).
    - `req_to_token_pool` / `token_to_kv_pool_allocator` may be None for tree-only use (tests
      that insert token ids as values); evicted slots then go nowhere.
    """

    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        page_size: int = 1,
        disable: bool = False,
        eviction_policy: str = "lru",
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        alloc_page = getattr(token_to_kv_pool_allocator, "page_size", page_size)
        if alloc_page != page_size:
            raise ValueError(f"RadixCache page_size {page_size} != allocator page_size {alloc_page}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self.disable = disable
        self.eviction_policy = eviction_policy
        self._heap = EvictHeap(eviction_policy)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = 0
        self._protected = 0
        self._clock = 0
        self._heap.clear()

    def reset(self) -> None:
        """Drop every node and give its slots back to the allocator.

        Only valid when no request holds a lock (the scheduler is idle): raises ValueError
        otherwise, because locked slots are in use by running requests.
        """
        if self._protected:
            raise ValueError(f"cannot reset the radix cache: {self._protected} tokens are locked by running requests")
        self._free_slots(self.all_values_flatten())
        self._init_tree()

    # -- sizes -------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # -- match / insert ----------------------------------------------------------------------

    def match_prefix(self, key: KeyLike) -> MatchResult:
        """Longest cached page-aligned prefix of `key` and its slots (one `torch.cat`: a new
        tensor, never a view of a node's value).

        A match that ends inside a node splits it, so `last_node` covers exactly the match.
        Touches access time and hit count of every node on the path.
        """
        key = as_radix_key(key)
        n = self._aligned(len(key))
        if self.disable or n == 0:
            return MatchResult(empty_indices(self.device), self.root)
        node, _, values = self._walk(key, n, count_hit=True)
        return MatchResult(torch.cat(values) if values else empty_indices(self.device), node)

    def insert(self, key: KeyLike, value: Optional[torch.Tensor] = None) -> int:
        """Insert `key -> value` (value None: the token ids themselves, for tests).

        Returns how many leading tokens were already present. The tree keeps its older slots for
        that span and takes `value[prefix:aligned_len]` (copied to a new int64 tensor); the
        caller still owns `value[:prefix]` and the unaligned tail (see `cache_finished_req`).
        """
        key = as_radix_key(key)
        if self.disable:
            return 0
        if value is None:
            value = torch.tensor(key.token_ids, dtype=torch.int64, device="cpu")
        if value.dim() != 1 or len(value) != len(key):
            raise ValueError(f"value must be 1-D with len(key)={len(key)} entries, got shape {tuple(value.shape)}")
        n = self._aligned(len(key))
        if n == 0:
            return 0
        node, pos, _ = self._walk(key, n, count_hit=False)
        if pos < n:
            self._add_leaf(node, key, pos, n, value)
        return pos

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def _child_key(self, packed: bytes, pos: int, extra_key: Optional[Hashable]) -> Hashable:
        """Dict key of the child whose key starts at token `pos` of `packed`."""
        first = packed[pos * _W : (pos + self.page_size) * _W]
        return first if extra_key is None else (extra_key, first)

    def _walk(self, key: RadixKey, n: int, count_hit: bool) -> Tuple[TreeNode, int, List[torch.Tensor]]:
        """Follow `key[:n]` from the root, splitting a node where the match ends inside it.

        Returns (deepest matched node, matched length, values along the path).
        """
        self._clock += 1
        now = self._clock
        extra_key, page = key.extra_key, self.page_size
        node, pos, values = self.root, 0, []
        while pos < n:
            packed = key.packed_upto(pos + page)
            child = node.children.get(self._child_key(packed, pos, extra_key))
            if child is None:
                break
            child_len = len(child.key)
            span = min(child_len, n - pos)
            matched = self._aligned(common_prefix_len(child.key.packed, key, pos, span))
            if matched < child_len:
                child = self._split(child, matched)  # only the matched part is touched
            child.last_access_time = now
            if count_hit:
                child.hit_count += 1
            values.append(child.value)
            node, pos = child, pos + matched
            if matched < child_len:
                break
        return node, pos, values

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` after `at` tokens; the new upper node takes the child's place and copies
        its lock_ref, access time and hit count, so the sizes are unchanged."""
        upper = TreeNode(child.key[:at], child.value[:at])
        upper.parent = child.parent
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        extra_key = child.key.extra_key
        upper.parent.children[self._child_key(child.key.packed, 0, extra_key)] = upper
        child.key = child.key[at:]
        child.value = child.value[at:]
        child.parent = upper
        upper.children[self._child_key(child.key.packed, 0, extra_key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: RadixKey, start: int, stop: int, value: torch.Tensor) -> None:
        leaf_key = RadixKey.from_packed(key.packed_upto(stop)[start * _W : stop * _W], key.extra_key)
        leaf = TreeNode(leaf_key, value[start:stop].to(torch.int64, copy=True))
        leaf.parent = parent
        leaf.last_access_time = self._clock
        parent.children[self._child_key(leaf_key.packed, 0, key.extra_key)] = leaf
        self._evictable += stop - start
        self._heap.push(leaf)

    # -- locks and eviction ------------------------------------------------------------------

    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Lock root..node; a 0 -> 1 node moves its tokens from evictable to protected."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            if node is None or node.evicted:
                raise AssertionError("inc_lock_ref on a node that is not in this tree")
            if node.lock_ref == 0:
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        """Unlock root..node; a 1 -> 0 node moves back to evictable (and, if a leaf, to the heap)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            if node is None or node.evicted:
                raise AssertionError("dec_lock_ref on a node that is not in this tree")
            if node.lock_ref <= 0:
                raise AssertionError(f"dec_lock_ref below zero on node {node.id}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.key)
                if not node.children:
                    self._heap.push(node)
            node = node.parent
        self._evictable += delta
        self._protected -= delta
        return delta

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return not node.evicted and node.lock_ref == 0 and not node.children

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves in policy order until `num_tokens` are freed or none is left.

        A parent that becomes an unlocked leaf joins the heap. Slots go back to the allocator in
        one `free` call. Returns the tokens freed (at most one node more than asked).
        """
        if self.disable or num_tokens <= 0:
            return 0
        freed, victims = 0, []
        while freed < num_tokens:
            node = self._heap.pop_victim(self._is_evictable_leaf)
            if node is None:
                break
            victims.append(node.value)
            freed += len(node.key)
            self._delete_leaf(node)
        if victims:
            self._free_slots(torch.cat(victims))
        return freed

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Give slots back to the allocator. `slots` must be whole pages laid out in order (as
        tree values and page-aligned row spans are), so one slot per page is enough: the paged
        allocator frees the page of each slot it is given."""
        if self.token_to_kv_pool_allocator is not None and slots.numel():
            self.token_to_kv_pool_allocator.free_aligned(slots)

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key.packed, 0, node.key.extra_key)]
        self._evictable -= len(node.key)
        node.evicted = True
        node.parent = None
        if parent is not self.root and parent.lock_ref == 0 and not parent.children:
            self._heap.push(parent)

    # -- request helpers ---------------------------------------------------------------------

    def cache_finished_req(self, req: PrefixCacheReq) -> None:
        """Insert prompt + output up to `kv_committed_len` (the last sampled token has no KV),
        free the duplicates and the unaligned tail, unlock `last_node`, free the row.

        Row index map at the call (p = cache_protected_len, k = prefix already in the tree,
        a = kv_committed_len rounded down to a page):
            [0, p)                   tree's slots, locked by this request      -> unchanged
            [p, k)                   duplicates of slots the tree already had   -> freed
            [k, a)                   adopted by the tree (new nodes)            -> tree
            [a, kv_allocated_len)    unaligned tail + uncommitted slots         -> freed
        Afterwards the request owns nothing (see `BasePrefixCache._release_row`).
        """
        if self.disable:
            self._finish_unshared(req)
            return
        committed, protected = self._check_req_lengths(req)
        token_ids = (req.origin_input_ids + req.output_ids)[:committed]
        if len(token_ids) < committed:
            raise AssertionError(f"kv_committed_len {committed} exceeds the request's {len(token_ids)} tokens")
        kv = self._row_slots(req, 0, req.kv_allocated_len)
        aligned = self._aligned(committed)
        in_tree = self.insert(RadixKey(token_ids[:aligned], req.extra_key), kv[:aligned])
        if in_tree < protected:
            raise AssertionError(f"request's locked prefix ({protected} tokens) is missing from the tree ({in_tree})")
        self._free_slots(torch.cat((kv[protected:in_tree], kv[aligned:])))  # both start on a page
        self.dec_lock_ref(req.last_node)
        self._release_row(req)

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Share `fill_ids[:kv_committed_len]` (page-aligned part), re-point the row at the
        tree's canonical slots, free the duplicates, move the lock to the new last node.

        Row index map (p = cache_protected_len, k = prefix already in the tree, a = aligned
        committed length): [0, p) unchanged; [p, k) request's duplicates freed and the row
        rewritten to the tree's slots; [k, a) adopted by the tree; [a, kv_allocated_len) stays
        private. Afterwards `cache_protected_len = a` and `prefix_indices` = the committed span.
        """
        if self.disable:
            self._keep_unshared(req)
            return
        committed, protected = self._check_req_lengths(req)
        if len(req.fill_ids) < committed:
            raise AssertionError(f"fill_ids has {len(req.fill_ids)} tokens < kv_committed_len {committed}")
        kv = self._row_slots(req, 0, committed)
        aligned = self._aligned(committed)
        key = RadixKey(req.fill_ids[:aligned], req.extra_key)
        in_tree = self.insert(key, kv[:aligned])
        if in_tree < protected:
            raise AssertionError(f"request's locked prefix ({protected} tokens) is missing from the tree ({in_tree})")
        self._free_slots(kv[protected:in_tree])
        new_last, matched, values = self._walk(key, aligned, count_hit=False) if aligned else (self.root, 0, [])
        if matched != aligned:
            raise AssertionError(f"re-match after insert found {matched} of {aligned} tokens")
        canonical = torch.cat(values) if values else kv[:0]
        self.req_to_token_pool.write(req.req_pool_idx, protected, canonical[protected:])
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.last_node = new_last
        req.cache_protected_len = aligned
        req.prefix_indices = torch.cat((canonical, kv[aligned:]))

    def _check_req_lengths(self, req: PrefixCacheReq) -> Tuple[int, int]:
        committed, protected = req.kv_committed_len, req.cache_protected_len
        if not (0 <= protected <= committed <= req.kv_allocated_len) or protected % self.page_size:
            raise AssertionError(
                f"bad request KV lengths: cache_protected_len={protected}, kv_committed_len={committed}, "
                f"kv_allocated_len={req.kv_allocated_len}, page_size={self.page_size}"
            )
        return committed, protected

    # -- inspection --------------------------------------------------------------------------

    def iter_nodes(self) -> List[TreeNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def all_values_flatten(self) -> torch.Tensor:
        """Every KV slot held by the tree (int64), e.g. for conservation checks."""
        values = [node.value for node in self.iter_nodes()]
        return torch.cat(values) if values else empty_indices(self.device)

    def check_invariants(self) -> None:
        check_radix_invariants(self)

    def pretty_print(self) -> str:
        lines = [f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, protected={self._protected})"]
        stack = [(child, 1) for child in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            lines.append(
                f"{'  ' * depth}{node.key!r} lock_ref={node.lock_ref} "
                f"t={node.last_access_time} hits={node.hit_count}"
            )
            stack.extend((child, depth + 1) for child in node.children.values())
        text = "\n".join(lines)
        logger.info("%s", text)
        return text
