"""Lazy min-heap of the radix cache's evictable leaves (LRU or LFU order).

Kept incrementally: a node that becomes an unlocked leaf is only *noted* (a list append, the
cheapest thing an insert or unlock can do) and filed into the heap by the next eviction, so
one eviction costs O(log n) per node popped or newly noted, never a rescan of the tree.
"""

from __future__ import annotations

import heapq
from typing import List, Optional, Tuple

from mem_cache.radix_tree_node import TreeNode

EVICTION_POLICIES = ("lru", "lfu")


def _lru(node: TreeNode) -> object:
    return node.last_access_time


def _lfu(node: TreeNode) -> object:
    return (node.hit_count, node.last_access_time)


def _is_unlocked_leaf(node: TreeNode) -> bool:
    return not (node.evicted or node.lock_ref or node.children)


class EvictHeap:
    """Min-heap of `(priority, node.id, node)` plus a list of noted nodes not filed yet; each
    node has at most one entry in the two together (`node.in_heap`).

    Priorities only grow (access times come from a monotonic clock, hit counts only rise), so
    an entry may be *stale*: lower than the node's current priority, or for a node that has
    since been locked, grown children or left the tree. `pop_victim` first files the noted
    nodes that are still unlocked leaves (at their current priority), then discards entries
    whose node is no longer an unlocked leaf and re-files entries whose priority is stale (one
    `heapreplace`, a single sift). Because every entry is a lower bound of its node's priority,
    the node it returns has the smallest current priority among all evictable leaves (ties
    broken by the older node id).

    Contract with the cache: every unlocked leaf in the tree has `in_heap == True`, which the
    cache ensures by calling `push` whenever a node becomes an unlocked leaf.
    """

    def __init__(self, policy: str = "lru"):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.policy = policy
        self.priority = _lru if policy == "lru" else _lfu
        self._heap: List[Tuple[object, int, TreeNode]] = []
        self._noted: List[TreeNode] = []

    def push(self, node: TreeNode) -> None:
        """Track `node` (idempotent: a node already holding an entry keeps that entry)."""
        if not node.in_heap:
            node.in_heap = True
            self._noted.append(node)

    def _file_noted(self) -> None:
        """Move the noted nodes that are still unlocked leaves into the heap (a heapify when
        they are many compared with the heap, else one push each)."""
        noted, self._noted = self._noted, []
        priority, entries = self.priority, []
        for node in noted:
            if _is_unlocked_leaf(node):
                entries.append((priority(node), node.id, node))
            else:
                node.in_heap = False
        heap = self._heap
        if len(entries) * 4 > len(heap):
            heap.extend(entries)
            heapq.heapify(heap)
        else:
            for entry in entries:
                heapq.heappush(heap, entry)

    def pop_victim(self) -> Optional[TreeNode]:
        """Remove and return the unlocked leaf with the lowest priority, or None."""
        if self._noted:
            self._file_noted()
        heap, priority = self._heap, self.priority
        while heap:
            prio, nid, node = heap[0]
            if not _is_unlocked_leaf(node):
                node.in_heap = False
                heapq.heappop(heap)
                continue
            current = priority(node)
            if current != prio:
                heapq.heapreplace(heap, (current, nid, node))
                continue
            node.in_heap = False
            heapq.heappop(heap)
            return node
        return None

    def clear(self) -> None:
        for _, _, node in self._heap:
            node.in_heap = False
        for node in self._noted:
            node.in_heap = False
        self._heap, self._noted = [], []

    def __len__(self) -> int:
        return len(self._heap) + len(self._noted)
