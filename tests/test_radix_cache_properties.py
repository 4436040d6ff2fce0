"""Property tests: random programs of insert / match / lock / unlock / evict and whole request
lives (admit, prefill chunks, decode, cache_unfinished_req, cache_finished_req) over a tiny
vocabulary and page sizes 1, 2, 4, checked against a reference model after every step.

Reference model: a dict `(namespace, page-aligned token prefix) -> KV slots of its last page`
for every page the tree should hold (prefix-closed; with page_size 1 a page is one token). After every step the tree's content equals it,
`check_invariants()` passes, and slot conservation holds with no slot in two places.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mem_cache.radix_cache import RadixCache, RadixKey
from test_cache_req_helpers import Harness, SimReq

Ref = Dict[Tuple[Optional[str], Tuple[int, ...]], Tuple[int, ...]]

SEQ = st.lists(st.integers(1, 3), max_size=10)
NS = st.sampled_from([None, "x"])
POOL_TOKENS = 48


def tree_content(cache: RadixCache) -> Ref:
    """`(namespace, prefix) -> slots of the prefix's last page` for every page in the tree."""
    out: Ref = {}
    P = cache.page_size
    stack = [(child, ()) for child in cache.root.children.values()]
    while stack:
        node, path = stack.pop()
        ids, slots = node.key.token_ids, node.value.tolist()
        for start in range(0, len(ids), P):
            path = path + tuple(ids[start : start + P])
            out[(node.key.extra_key, path)] = tuple(slots[start : start + P])
        stack.extend((child, path) for child in node.children.values())
    return out


def longest_present(ref: Ref, ns: Optional[str], seq: List[int], page: int) -> int:
    """Reference answer: the longest page-aligned prefix of `seq` held in the model."""
    n = len(seq) - len(seq) % page
    k = 0
    while k < n and (ns, tuple(seq[: k + page])) in ref:
        k += page
    return k


class RadixProgram(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page: int, policy: str) -> None:
        self.page = page
        self.policy = policy
        self.h = Harness(page_size=page, pool_tokens=POOL_TOKENS, rows=6, ctx=64)
        self.h.cache = RadixCache(self.h.req_pool, self.h.alloc, page_size=page, eviction_policy=policy)
        self.cache = self.h.cache
        self.ref: Ref = {}
        self.locks: List[Tuple[object, Optional[str], Tuple[int, ...]]] = []

    # -- helpers -------------------------------------------------------------------------------

    def expected_slots(self, ns: Optional[str], seq: List[int], k: int) -> List[int]:
        P = self.page
        return [slot for end in range(P, k + 1, P) for slot in self.ref[(ns, tuple(seq[:end]))]]

    def adopt(self, ns: Optional[str], seq: List[int], slots: List[int]) -> int:
        """Model an insert of `seq` (page-aligned) with `slots`: returns the expected prefix."""
        n = len(seq) - len(seq) % self.page
        present = longest_present(self.ref, ns, seq, self.page)
        for end in range(present + self.page, n + 1, self.page):
            self.ref[(ns, tuple(seq[:end]))] = tuple(slots[end - self.page : end])
        return present

    def evict_and_sync(self, num_tokens: int) -> None:
        before, evictable = dict(self.ref), self.cache.evictable_size()
        nodes = self.cache.iter_nodes()
        longest_node = max((len(n.key) for n in nodes), default=0)
        leaves = [n for n in nodes if n.lock_ref == 0 and not n.children]
        first_victim = min(leaves, key=self.eviction_order) if leaves else None
        freed = self.cache.evict(num_tokens)
        if num_tokens > 0 and first_victim is not None:
            assert first_victim.evicted, "the least recently (lfu: least often) used leaf was not evicted first"
        if evictable <= num_tokens:
            assert freed == evictable, (freed, evictable)
        else:
            assert num_tokens <= freed < num_tokens + longest_node, (freed, num_tokens)
        after = tree_content(self.cache)
        assert all(before.get(k) == v for k, v in after.items()), "eviction invented or moved slots"
        for _, ns, prefix in self.locks:
            assert (ns, prefix) in after or not prefix, f"locked prefix {prefix} was evicted"
        for req in self.h.live:
            if req.cache_protected_len:
                assert (req.extra_key, tuple(req.all_ids[: req.cache_protected_len])) in after
        self.ref = after

    def eviction_order(self, node) -> tuple:
        if self.policy == "lru":
            return (node.last_access_time, node.id)
        return (node.hit_count, node.last_access_time, node.id)

    def ensure_free(self, tokens: int) -> bool:
        short = tokens - self.h.alloc.available_size()
        if short > 0:
            self.evict_and_sync(short)
        return self.h.alloc.available_size() >= tokens

    # -- tree operations ---------------------------------------------------------------------------

    @rule(seq=SEQ, ns=NS)
    def insert(self, seq: List[int], ns: Optional[str]) -> None:
        pages = -(-len(seq) // self.page)
        if not self.ensure_free(pages * self.page):
            return
        slots = self.h.alloc.alloc(pages * self.page)[: len(seq)]
        expected = self.adopt(ns, seq, slots.tolist())
        got = self.cache.insert(RadixKey(seq, ns), slots)
        assert got == expected, (got, expected)
        aligned = len(seq) - len(seq) % self.page
        self.h.alloc.free(torch.cat((slots[:got], slots[aligned:])))

    @rule(seq=SEQ, ns=NS)
    def match(self, seq: List[int], ns: Optional[str]) -> None:
        result = self.cache.match_prefix(RadixKey(seq, ns))
        k = longest_present(self.ref, ns, seq, self.page)
        assert len(result.device_indices) == k
        assert result.device_indices.tolist() == self.expected_slots(ns, seq, k)
        assert result.last_node is self.cache.root or len(result.last_node.key) > 0

    @precondition(lambda self: self.ref)
    @rule(i=st.integers(0, 10**6), extra=SEQ)
    def match_cached(self, i: int, extra: List[int]) -> None:
        """Match a prefix the tree holds (plus noise): deep hits, and stale heap priorities."""
        ns, prefix = sorted(self.ref, key=repr)[i % len(self.ref)]
        self.match(list(prefix) + extra, ns)

    @rule(seq=SEQ, ns=NS)
    def lock(self, seq: List[int], ns: Optional[str]) -> None:
        result = self.cache.match_prefix(RadixKey(seq, ns))
        self.cache.inc_lock_ref(result.last_node)
        self.locks.append((result.last_node, ns, tuple(seq[: len(result.device_indices)])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i: int) -> None:
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(n=st.one_of(st.integers(1, 4), st.integers(0, POOL_TOKENS)))
    def evict(self, n: int) -> None:
        self.evict_and_sync(n)

    # -- request lives -----------------------------------------------------------------------------

    @precondition(lambda self: self.h.req_pool.available_size() > 0)
    @rule(prompt=SEQ.filter(bool), ns=NS)
    def admit(self, prompt: List[int], ns: Optional[str]) -> None:
        req = self.h.admit(prompt, ns)
        k = longest_present(self.ref, ns, prompt[:-1], self.page)
        assert req.cache_protected_len == k
        assert req.prefix_indices.tolist() == self.expected_slots(ns, prompt, k)

    @precondition(lambda self: self.h.live)
    @rule(i=st.integers(0, 100), n=st.integers(1, 6), token=st.integers(1, 3))
    def step(self, i: int, n: int, token: int) -> None:
        """Prefill up to n more tokens, or (all computed) sample one output token."""
        req = self.h.live[i % len(self.h.live)]
        todo = len(req.all_ids) - req.kv_committed_len
        if todo == 0:
            if len(req.all_ids) < 20:
                req.output_ids.append(token)
            return
        n = min(n, todo)
        a, P = req.kv_allocated_len, self.page
        if self.ensure_free((-(-(a + n) // P) - (-(-a // P))) * P):
            assert self.h.extend(req, n)

    def _model_req_insert(self, req: SimReq, tokens: List[int]) -> int:
        row = self.h.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
        return self.adopt(req.extra_key, tokens, row)

    @precondition(lambda self: self.h.live)
    @rule(i=st.integers(0, 100))
    def cache_unfinished(self, i: int) -> None:
        req = self.h.live[i % len(self.h.live)]
        fill = req.fill_ids[: req.kv_committed_len]
        self._model_req_insert(req, fill)
        self.cache.cache_unfinished_req(req)
        aligned = len(fill) - len(fill) % self.page
        assert req.cache_protected_len == aligned
        row = self.h.req_pool.req_to_token[req.req_pool_idx, :aligned].tolist()
        assert row == self.expected_slots(req.extra_key, fill, aligned), "row not rewritten to canonical slots"
        assert req.prefix_indices.tolist()[:aligned] == row and len(req.prefix_indices) == req.kv_committed_len

    @precondition(lambda self: self.h.live)
    @rule(i=st.integers(0, 100))
    def cache_finished(self, i: int) -> None:
        req = self.h.live[i % len(self.h.live)]
        self._model_req_insert(req, req.all_ids[: req.kv_committed_len])
        self.h.finish(req)

    # -- after every step --------------------------------------------------------------------------

    @invariant()
    def tree_equals_reference_and_slots_are_conserved(self) -> None:
        if not hasattr(self, "h"):
            return
        assert tree_content(self.cache) == self.ref
        self.h.check()
        if not self.h.live and not self.locks:
            assert self.cache.protected_size() == 0


RadixProgram.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
TestRadixProgram = RadixProgram.TestCase


@settings(max_examples=150, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**31 - 1), max_size=300),
    packed_first=st.integers(0, 300),
    start=st.integers(0, 300),
    stop=st.integers(0, 300),
)
def test_radix_key_slices_match_the_list_however_much_was_packed(ids, packed_first, start, stop):
    key = RadixKey(ids, extra_key="ns")
    key.packed_upto(packed_first)
    part = key[start:stop]
    assert part.token_ids == ids[start:stop] and part.extra_key == "ns"
    assert part.packed == RadixKey(ids[start:stop]).packed
    assert RadixKey.from_packed(key.packed).token_ids == ids


@settings(max_examples=150, deadline=None)
@given(
    base=st.lists(st.integers(1, 2), max_size=300),
    cut=st.integers(0, 300),
    tail=st.lists(st.integers(1, 2), max_size=40),
    page=st.sampled_from([1, 2, 4, 16]),
)
def test_match_length_is_the_page_aligned_common_prefix(base, cut, tail, page):
    """Long keys, divergence anywhere: the bisection agrees with a plain loop."""
    cache = RadixCache(None, None, page_size=page)
    cache.insert(base)
    query = base[:cut] + tail
    common = 0
    while common < min(len(base), len(query)) and base[common] == query[common]:
        common += 1
    expected = common - common % page
    result = cache.match_prefix(query)
    assert result.device_indices.tolist() == base[:expected]
    assert cache.total_size() == len(base) - len(base) % page
    cache.check_invariants()


def test_a_full_drain_returns_every_slot():
    """After all requests finish and all locks drop, evicting everything empties the tree."""
    h = Harness(page_size=2, pool_tokens=POOL_TOKENS)
    for prompt in ([1, 2, 3, 1, 2], [1, 2, 3, 3], [2, 2, 2, 2, 2, 2, 1]):
        h.run(prompt, [3, 1])
    h.cache.evict(10**6)
    assert h.alloc.available_size() == POOL_TOKENS and h.cache.total_size() == 0
    h.check()
