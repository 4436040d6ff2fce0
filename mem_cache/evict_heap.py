"""Lazy-deletion min-heap of the radix cache's evictable leaves (LRU or LFU order).

Kept incrementally (a node is pushed when it becomes an unlocked leaf), so one eviction
costs O(log n) per node popped, never a rescan of the tree.
"""

from __future__ import annotations

import heapq
from typing import Callable, List, Optional, Tuple

from mem_cache.radix_tree_node import TreeNode

EVICTION_POLICIES = ("lru", "lfu")


class EvictHeap:
    """Min-heap of `(priority, node.id, node)` with at most one entry per node.

    Priorities only grow (access times come from a monotonic clock, hit counts only rise), so
    an entry may be *stale*: lower than the node's current priority, or for a node that has
    since been locked, grown children or left the tree. `pop_victim` discards entries whose
    node is no longer evictable and re-pushes entries whose priority is stale; because every
    entry is a lower bound of its node's priority, the node it returns has the smallest
    current priority among all evictable leaves (ties broken by the older node id).

    Contract with the cache: every unlocked leaf in the tree has `in_heap == True`, which the
    cache ensures by calling `push` whenever a node becomes an unlocked leaf.
    """

    def __init__(self, policy: str = "lru"):
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {policy!r}")
        self.policy = policy
        self._heap: List[Tuple[object, int, TreeNode]] = []

    def priority(self, node: TreeNode) -> object:
        """LRU: last access time. LFU: (hit count, last access time)."""
        if self.policy == "lru":
            return node.last_access_time
        return (node.hit_count, node.last_access_time)

    def push(self, node: TreeNode) -> None:
        """Track `node` (idempotent: a node already holding an entry keeps that entry)."""
        if node.in_heap:
            return
        node.in_heap = True
        heapq.heappush(self._heap, (self.priority(node), node.id, node))

    def pop_victim(self, is_evictable: Callable[[TreeNode], bool]) -> Optional[TreeNode]:
        """Remove and return the evictable leaf with the lowest priority, or None."""
        heap = self._heap
        while heap:
            prio, nid, node = heapq.heappop(heap)
            if not is_evictable(node):
                node.in_heap = False
                continue
            current = self.priority(node)
            if current != prio:
                heapq.heappush(heap, (current, nid, node))
                continue
            node.in_heap = False
            return node
        return None

    def clear(self) -> None:
        for _, _, node in self._heap:
            node.in_heap = False
        self._heap = []

    def __len__(self) -> int:
        return len(self._heap)
