"""`SchedulePolicy`: the order in which waiting requests are offered to the `PrefillAdder`
(`--schedule-policy`). The adder itself, and the in-batch prefix sharing that applies under
every policy, live in `managers/prefill_adder.py`.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import TYPE_CHECKING, Dict, List, Optional, Set

from managers.prefill_adder import (
    CLIP_MAX_NEW_TOKENS, IN_BATCH_PREFIX_MIN_TOKENS, AddReqResult, InBatchPrefixIndex, PrefillAdder,
)

if TYPE_CHECKING:
    from managers.req import Req

__all__ = ["SchedulePolicy", "PrefillAdder", "AddReqResult", "CLIP_MAX_NEW_TOKENS"]

CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
CACHE_AGNOSTIC_POLICIES = ("fcfs", "lof", "random")

# Above this many waiting requests the cache-aware policies fall back to fcfs: matching every
# waiting request against the tree each round would cost more than it saves.
CACHE_AWARE_MAX_QUEUE = 128


class SchedulePolicy:
    """Sorts the waiting queue in place each round (`calc_priority`).

    - fcfs: arrival order (`Req.created_time`, stable), so a retracted request goes back ahead
      of newer ones.
    - lof: largest `max_new_tokens` first (stable).
    - random: a shuffle drawn from `rng` (default: `random.Random(0)`, reproducible).
    - lpm: longest cached prefix first, except that a request sharing at least
      `IN_BATCH_PREFIX_MIN_TOKENS` uncached tokens with an earlier waiting request goes to the
      back (`deferred_sharers`), so the budget goes to requests that do not wait anyway; ties
      in arrival order.
    - dfs-weight: depth-first over the radix tree, heavier subtrees (more waiting requests whose
      match ends inside) first, so requests sharing a prefix run together.
    lpm and dfs-weight call `req.init_next_round_input(tree_cache)` for every waiting request
    (fresh, unlocked matches). They act as fcfs when the cache is disabled and, when
    `enable_priority_fallback`, when more than `CACHE_AWARE_MAX_QUEUE` requests wait.
    Whatever the order, the `PrefillAdder` holds back a request that would recompute what a
    request admitted in the same batch computes.
    """

    def __init__(
        self,
        policy: str,
        tree_cache,
        enable_priority_fallback: bool = True,
        *,
        rng: Optional[random.Random] = None,
    ):
        if policy not in CACHE_AWARE_POLICIES + CACHE_AGNOSTIC_POLICIES:
            choices = ", ".join(CACHE_AWARE_POLICIES + CACHE_AGNOSTIC_POLICIES)
            raise ValueError(f"Invalid --schedule-policy {policy!r}. Accepted values: {choices}.")
        self.policy = policy
        self.tree_cache = tree_cache
        self.enable_priority_fallback = enable_priority_fallback
        self.rng = rng if rng is not None else random.Random(0)

    def active_policy(self, num_waiting: int) -> str:
        """The policy actually applied to a queue of `num_waiting` requests."""
        if self.policy not in CACHE_AWARE_POLICIES:
            return self.policy
        if getattr(self.tree_cache, "disable", False):
            return "fcfs"
        if self.enable_priority_fallback and num_waiting > CACHE_AWARE_MAX_QUEUE:
            return "fcfs"
        return self.policy

    def calc_priority(self, waiting_queue: List[Req]) -> None:
        """Sort `waiting_queue` in place (see the class docstring)."""
        policy = self.active_policy(len(waiting_queue))
        if policy == "fcfs":
            waiting_queue.sort(key=lambda r: r.created_time)
        elif policy == "lof":
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        else:
            for req in waiting_queue:
                req.init_next_round_input(self.tree_cache)
            if policy == "lpm":
                self._sort_by_longest_prefix(waiting_queue)
            else:
                self._sort_by_dfs_weight(waiting_queue)

    # ------------------------------------------------------------------ lpm
    @staticmethod
    def deferred_sharers(waiting_queue: List[Req]) -> Set[int]:
        """`id()`s of requests to push back: in arrival order, each request is matched against the
        earlier, not deferred, waiting requests (`InBatchPrefixIndex`); it is deferred when they
        share at least `IN_BATCH_PREFIX_MIN_TOKENS` tokens beyond its own cached prefix."""
        index = InBatchPrefixIndex()
        deferred: Set[int] = set()
        for req in sorted(waiting_queue, key=lambda r: r.created_time):
            if index.shared_uncached_len(req) >= IN_BATCH_PREFIX_MIN_TOKENS:
                deferred.add(id(req))
            else:
                index.add(req)
        return deferred

    def _sort_by_longest_prefix(self, waiting_queue: List[Req]) -> None:
        deferred = self.deferred_sharers(waiting_queue)
        waiting_queue.sort(key=lambda r: (id(r) in deferred, -len(r.prefix_indices), r.created_time))

    # ------------------------------------------------------------------ dfs-weight
    def _sort_by_dfs_weight(self, waiting_queue: List[Req]) -> None:
        """Post-order DFS over the part of the tree that waiting requests reach: at each node the
        children go heaviest first (ties: earliest arrival inside), then the requests whose match
        ends at the node itself, in arrival order."""
        root = self.tree_cache.root
        reqs_at: Dict[object, List[Req]] = defaultdict(list)
        for req in sorted(waiting_queue, key=lambda r: r.created_time):
            reqs_at[req.last_node if req.last_node is not None else root].append(req)

        weight: Dict[object, int] = defaultdict(int)
        earliest: Dict[object, float] = {}
        children: Dict[object, list] = defaultdict(list)
        for node, reqs in reqs_at.items():
            first = reqs[0].created_time
            while node is not None:
                if node not in earliest:
                    earliest[node] = first
                    if node.parent is not None:
                        children[node.parent].append(node)
                weight[node] += len(reqs)
                earliest[node] = min(earliest[node], first)
                node = node.parent

        ordered: List[Req] = []
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                ordered.extend(reqs_at.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted(children.get(node, ()), key=lambda n: (-weight[n], earliest[n]))
            stack.extend((kid, False) for kid in reversed(kids))
        assert len(ordered) == len(waiting_queue), "dfs-weight lost or duplicated a waiting request"
        waiting_queue[:] = ordered
