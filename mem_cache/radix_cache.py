"""Radix-tree prefix cache: the longest cached prefix of a request is KV it does not recompute.

Match and insert compare whole spans (`bytes ==` on lazily packed int32 keys, bisection to find
a divergence point), never token by token in Python. A new leaf keeps a window on the caller's
token list and, where that is safe, a view of the caller's slot tensor, so an insert packs and
copies nothing it does not compare. Eviction pops a lazy heap of unlocked leaves kept up to date
incrementally. Semantics: ARCHITECTURE.md section 4.2.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, List, Optional, Tuple

import torch

from mem_cache.base_prefix_cache import BasePrefixCache, KeyLike, MatchResult, as_radix_key, empty_indices
from mem_cache.evict_heap import EvictHeap
from mem_cache.radix_invariants import check_radix_invariants
from mem_cache.radix_tree_node import RadixKey, TreeNode, common_prefix_len, node_slots
from mem_cache.req_protocol import PrefixCacheReq

logger = logging.getLogger(__name__)

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
    - Node values may be views of the tensors given to `insert` (see there); the tree never
      writes to them and never keeps a view of a `req_to_token` row.
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
        self._empty = empty_indices(self.device)  # the (shared, never written) result of a miss
        self._rows = getattr(req_to_token_pool, "req_to_token", None)  # never aliased by a node value
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        self._evictable = self._protected = self._clock = 0
        self._heap.clear()

    def reset(self) -> None:
        """Drop every node and give its slots back to the allocator. Only while no request holds
        a lock (the scheduler is idle): raises ValueError otherwise (those slots are in use)."""
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
        tensor, never a view of a node's value; a miss returns a shared empty tensor).

        A match that ends inside a node splits it, so `last_node` covers exactly the match.
        Touches access time and hit count of every node on the path.
        """
        key = as_radix_key(key)
        n = self._aligned(len(key))
        if self.disable or n == 0:
            return MatchResult(self._empty, self.root)
        self._clock += 1
        node, _, values, _ = self._walk(self.root, key, n, count_hit=True)
        return MatchResult(torch.cat(values) if values else self._empty, node)

    def insert(self, key: KeyLike, value: Optional[torch.Tensor] = None) -> int:
        """Insert `key -> value` (value None: the token ids themselves, for tests).

        Returns how many leading tokens were already present. The tree keeps its older slots for
        that span and takes `value[prefix:aligned_len]`; the caller still owns `value[:prefix]`
        and the unaligned tail (see `cache_finished_req`). Nothing is packed or copied beyond
        what is compared: the new leaf keeps a window on the key's token list (do not change it
        in place afterwards; appending is fine) and, mostly, a view of `value` (do not write into
        it afterwards; `node_slots` says when it is copied). Token ids must fit in int32; ids
        stored without being compared are checked when first packed (by a later match).
        """
        if self.disable:
            return 0
        ids = None
        if isinstance(key, RadixKey):
            length = len(key)
        else:
            ids = key if type(key) is list else list(key)
            length = len(ids)
        if value is None:
            value = torch.tensor(key.token_ids if ids is None else ids, dtype=torch.int64, device="cpu")
        if value.ndim != 1 or value.numel() != length:
            raise ValueError(f"value must be 1-D with len(key)={length} entries, got shape {tuple(value.shape)}")
        n = length - length % self.page_size
        if n == 0:
            return 0
        if ids is not None:  # a plain list: a fixed key over its whole pages, the new leaf's key on a miss
            key = RadixKey(ids, None, n)
        self._clock += 1
        node, pos, _, child_key = self._walk(self.root, key, n, count_hit=False)
        if pos < n:
            self._add_leaf(node, key, pos, n, value, length, child_key)
        return pos

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def child_key_of(self, key: RadixKey, pos: int = 0) -> Hashable:
        """Dict key of a child whose key starts like `key[pos:]`: its first token (page size 1)
        or a tuple of its first page's tokens, with the namespace when there is one."""
        first = key.page_key(pos, self.page_size)
        return first if key.extra_key is None else (key.extra_key, first)

    def _walk(self, node: TreeNode, key: RadixKey, n: int, count_hit: bool) -> Tuple[TreeNode, int, List[torch.Tensor], Any]:
        """Follow `key[:n]` down from `node`, splitting a node where the match ends inside it;
        touches the path with the current clock (the caller ticks it). Returns (deepest matched
        node, matched length, values below `node`, the child key that missed or None)."""
        now, pos, values = self._clock, 0, []
        page, extra_key = self.page_size, key.extra_key
        while pos < n:
            first = key.page_key(pos, page)  # as child_key_of, inlined: this is the hot loop
            child_key = first if extra_key is None else (extra_key, first)
            child = node.children.get(child_key)
            if child is None:
                return node, pos, values, child_key
            child_len = len(child.key)
            span = min(child_len, n - pos)
            matched = common_prefix_len(child.key, key, pos, span)
            matched -= matched % page
            if matched < child_len:
                child = self._split(child, matched)  # only the matched part is touched
            child.last_access_time = now
            if count_hit:
                child.hit_count += 1
            values.append(child.value)
            node, pos = child, pos + matched
            if matched < child_len:
                break
        return node, pos, values, None

    def _split(self, child: TreeNode, at: int) -> TreeNode:
        """Cut `child` after `at` tokens; the new upper node takes the child's place and copies
        its lock_ref, access time and hit count, so the sizes are unchanged. Keys and values
        are cut as windows / views: nothing is copied."""
        upper = TreeNode(child.key.window(0, at), child.value[:at], child.parent, child.last_access_time)
        upper.lock_ref, upper.hit_count = child.lock_ref, child.hit_count
        upper.parent.children[self.child_key_of(upper.key)] = upper
        child.key = child.key.window(at, len(child.key))
        child.value = child.value[at:]
        child.parent = upper
        upper.children[self.child_key_of(child.key)] = child
        return upper

    def _add_leaf(self, parent: TreeNode, key: RadixKey, start: int, stop: int, value: torch.Tensor,
                  whole: int, child_key: Any = None) -> TreeNode:
        """Hang `key[start:stop] -> value[start:stop]` under `parent` (`whole` = len(value);
        `child_key`: the leaf's dict key if the walk already computed it)."""
        slots = node_slots(value, start, stop, whole, self._rows)
        leaf = TreeNode(key.window(start, stop), slots, parent, self._clock)
        parent.children[child_key if child_key is not None else self.child_key_of(leaf.key)] = leaf
        self._evictable += stop - start
        self._heap.push(leaf)
        return leaf

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

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves in policy order until `num_tokens` are freed or none is left; a
        parent that becomes an unlocked leaf joins the heap. Slots go back to the allocator in
        one `free` call. Returns the tokens freed (at most one node more than asked)."""
        if self.disable or num_tokens <= 0:
            return 0
        freed, victims, pop = 0, [], self._heap.pop_victim
        while freed < num_tokens:
            node = pop()
            if node is None:
                break
            victims.append(node.value)
            freed += len(node.key)
            self._delete_leaf(node)
        if victims:  # the slots now belong to the allocator alone: no copy needed for one node
            self._free_slots(victims[0] if len(victims) == 1 else torch.cat(victims))
        return freed

    def _free_slots(self, slots: torch.Tensor) -> None:
        """Give slots back. They must be whole pages in order (as tree values and page-aligned
        row spans are): the paged allocator frees the page of every P-th slot."""
        if self.token_to_kv_pool_allocator is not None and slots.numel():
            self.token_to_kv_pool_allocator.free_aligned(slots)

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self.child_key_of(node.key)]
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
        [0, p) is neither compared nor packed: the walk starts at the locked `last_node`.
        The tree adopts views of one int64 copy of the row's [p, kv_allocated_len), never of
        the row itself. Afterwards the request owns nothing (see `BasePrefixCache._release_row`).
        """
        if self.disable:
            self._finish_unshared(req)
            return
        committed, protected = self._check_req_lengths(req)
        origin, output = req.origin_input_ids, req.output_ids
        if len(origin) + len(output) < committed:
            raise AssertionError(f"kv_committed_len {committed} exceeds the request's {len(origin) + len(output)} tokens")
        n = self._aligned(committed) - protected
        self._clock += 1
        start = self._enter_at_lock(req, protected)
        kv = self._row_copy(req, protected, req.kv_allocated_len)
        a, m = protected + n, len(origin)
        key = RadixKey(origin[protected:a] + output[max(protected - m, 0) : max(a - m, 0)], req.extra_key, fixed=True)
        node, matched, _, child_key = self._walk(start, key, n, count_hit=False)
        if matched < n:
            self._add_leaf(node, key, matched, n, kv, len(kv), child_key)
        self._free_slots(torch.cat((kv[:matched], kv[n:])))  # both start on a page
        self.dec_lock_ref(req.last_node)
        self._release_row(req)

    def cache_unfinished_req(self, req: PrefixCacheReq) -> None:
        """Share `fill_ids[:kv_committed_len]` (page-aligned part), re-point the row at the
        tree's canonical slots, free the duplicates, move the lock to the new last node.

        Row index map (p = cache_protected_len, k = prefix already in the tree, a = aligned
        committed length): [0, p) unchanged (not compared: the walk starts at `last_node`);
        [p, k) request's duplicates freed and the row rewritten to the tree's slots; [k, a)
        adopted by the tree; [a, kv_allocated_len) stays private. Afterwards
        `cache_protected_len = a` and `prefix_indices` = the committed span.
        """
        if self.disable:
            self._keep_unshared(req)
            return
        committed, protected = self._check_req_lengths(req)
        if len(req.fill_ids) < committed:
            raise AssertionError(f"fill_ids has {len(req.fill_ids)} tokens < kv_committed_len {committed}")
        aligned = self._aligned(committed)
        n = aligned - protected
        self._clock += 1
        start = self._enter_at_lock(req, protected)
        kv = self._row_copy(req, protected, committed)
        key = RadixKey(req.fill_ids[protected:aligned], req.extra_key, fixed=True)
        new_last, matched, values, child_key = self._walk(start, key, n, count_hit=False)
        if matched < n:
            new_last = self._add_leaf(new_last, key, matched, n, kv, len(kv), child_key)
            values.append(new_last.value)
        self._free_slots(kv[:matched])
        canonical = torch.cat(values) if values else kv[:0]  # the tree's slots for [p, a)
        self.req_to_token_pool.write(req.req_pool_idx, protected, canonical)
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(req.last_node)
        req.last_node = new_last
        req.cache_protected_len = aligned
        req.prefix_indices = torch.cat((self._row_copy(req, 0, protected), canonical, kv[n:]))

    def _enter_at_lock(self, req: PrefixCacheReq, protected: int) -> TreeNode:
        """Where a request helper's walk starts: `last_node`, whose root path holds the
        request's first `protected` tokens (its lock keeps them in the tree). Touches that path
        with the current clock, as a walk from the root would."""
        node = req.last_node if protected else self.root
        depth, cur = 0, node
        while cur is not self.root:
            if cur is None or cur.evicted:
                raise AssertionError("the request's last_node is not in this tree")
            cur.last_access_time = self._clock
            depth += len(cur.key)
            cur = cur.parent
        if depth != protected:
            raise AssertionError(f"request's last_node covers {depth} tokens but cache_protected_len is {protected}")
        return node

    def _row_copy(self, req: PrefixCacheReq, start: int, stop: int) -> torch.Tensor:
        """A new int64 tensor of `req_to_token[req_pool_idx, start:stop]`, never a view of the row
        (which is rewritten when reused), so the tree may keep views of it."""
        if req.req_pool_idx is None:
            raise AssertionError("request has no req_to_token row (already finished or retracted?)")
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        return row[start:stop].to(torch.int64, copy=True)

    def _check_req_lengths(self, req: PrefixCacheReq) -> Tuple[int, int]:
        committed, protected = req.kv_committed_len, req.cache_protected_len
        if not (0 <= protected <= committed <= req.kv_allocated_len) or protected % self.page_size:
            raise AssertionError(f"bad request KV lengths: cache_protected_len={protected}, kv_committed_len="
                                 f"{committed}, kv_allocated_len={req.kv_allocated_len}, page_size={self.page_size}")
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
        """Every KV slot held by the tree (int64, a new tensor), e.g. for conservation checks."""
        values = [node.value for node in self.iter_nodes()]
        return torch.cat(values) if values else empty_indices(self.device)

    def check_invariants(self) -> None:
        check_radix_invariants(self)

    def pretty_print(self) -> str:
        lines = [f"RadixCache(page_size={self.page_size}, evictable={self._evictable}, protected={self._protected})"]
        stack = [(child, 1) for child in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            lines.append(f"{'  ' * depth}{node.key!r} lock_ref={node.lock_ref} t={node.last_access_time} hits={node.hit_count}")
            stack.extend((child, depth + 1) for child in node.children.values())
        text = "\n".join(lines)
        logger.info("%s", text)
        return text

