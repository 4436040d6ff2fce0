"""Waiting-queue order (`SchedulePolicy`) and prefill admission (`PrefillAdder`) against a real
radix cache, slot allocator and request-slot pool."""

from __future__ import annotations

import random
from typing import List, Optional

import pytest

from managers.req import Req
from managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult, PrefillAdder, SchedulePolicy
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.chunk_cache import ChunkCache
from mem_cache.memory_pool import ReqToTokenPool
from mem_cache.radix_cache import RadixCache, RadixKey
from mem_cache.radix_invariants import check_kv_conservation
from srt.sampling.sampling_params import SamplingParams


class Pools:
    """Allocator + request-slot pool + radix cache, as the scheduler owns them."""

    def __init__(self, size: int = 1000, page_size: int = 1, kind: str = "radix"):
        P = page_size
        self.alloc = TokenToKVPoolAllocator(size) if P == 1 else PagedTokenToKVPoolAllocator(size, P)
        self.req_pool = ReqToTokenPool(8, 512)
        if kind == "chunk":
            self.cache = ChunkCache(self.req_pool, self.alloc, page_size=P)
        else:
            self.cache = RadixCache(self.req_pool, self.alloc, page_size=P, disable=(kind == "disabled"))

    def cache_seq(self, tokens: List[int]) -> None:
        """Put `tokens` in the tree with slots taken from the allocator (duplicates freed)."""
        slots = self.alloc.alloc(len(tokens))
        in_tree = self.cache.insert(RadixKey(list(tokens)), slots)
        self.alloc.free(slots[:in_tree])

    def adder(self, running=(), ratio: float = 1.0, max_prefill: int = 10_000,
              chunk: Optional[int] = None, slots: int = 8) -> PrefillAdder:
        return PrefillAdder(self.cache.page_size, self.cache, self.alloc, list(running), ratio,
                            max_prefill, chunk, slots)

    def prefill(self, req: Req) -> None:
        """The scheduler's part after admission: row, KV for the chunk, then cache the chunk."""
        if req.req_pool_idx is None:
            req.req_pool_idx = self.req_pool.alloc(1)[0]
            self.req_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        start, end = len(req.prefix_indices), len(req.fill_ids)
        row = self.req_pool.req_to_token[req.req_pool_idx]
        last_loc = int(row[start - 1]) if start else 0
        slots = self.alloc.alloc_extend([start], [end], [last_loc])
        self.req_pool.write(req.req_pool_idx, start, slots)
        req.kv_committed_len = req.kv_allocated_len = end
        self.cache.cache_unfinished_req(req)


_next_token = iter(range(10_000, 10**9))


def fresh(n: int) -> List[int]:
    """`n` token ids never used before (no accidental prefix sharing between tests)."""
    return [next(_next_token) for _ in range(n)]


def make_req(tokens: List[int], max_new: int = 16, rid: Optional[str] = None, output: int = 0) -> Req:
    req = Req(rid or f"r{tokens[0]}", tokens, SamplingParams(max_new_tokens=max_new))
    req.output_ids = fresh(output)
    return req


def ready(req: Req, pools: Pools) -> Req:
    req.init_next_round_input(pools.cache)
    return req


def rids(queue: List[Req]) -> List[str]:
    return [r.rid for r in queue]


# -- SchedulePolicy ----------------------------------------------------------------------------


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="lpm"):
        SchedulePolicy("shortest-first", Pools().cache)


def test_fcfs_restores_arrival_order():
    reqs = [make_req(fresh(5), rid=f"a{i}") for i in range(6)]
    queue = [reqs[3], reqs[0], reqs[5], reqs[1], reqs[4], reqs[2]]
    SchedulePolicy("fcfs", Pools().cache).calc_priority(queue)
    assert rids(queue) == [f"a{i}" for i in range(6)]


def test_lof_orders_by_max_new_tokens_desc_and_keeps_ties_in_order():
    queue = [make_req(fresh(5), max_new=m, rid=f"q{i}") for i, m in enumerate([10, 50, 10, 50, 30])]
    SchedulePolicy("lof", Pools().cache).calc_priority(queue)
    assert rids(queue) == ["q1", "q3", "q4", "q0", "q2"]


def test_random_is_a_seedable_permutation():
    def shuffled(seed: int) -> List[str]:
        queue = [make_req([i + 1, i + 2], rid=f"s{i}") for i in range(20)]
        SchedulePolicy("random", Pools().cache, rng=random.Random(seed)).calc_priority(queue)
        return rids(queue)

    first = shuffled(7)
    assert sorted(first) == sorted(f"s{i}" for i in range(20))
    assert first != [f"s{i}" for i in range(20)]
    assert first == shuffled(7)


def test_lpm_puts_the_longest_cached_prefix_first():
    pools = Pools()
    long_prefix, short_prefix = fresh(100), fresh(40)
    pools.cache_seq(long_prefix)
    pools.cache_seq(short_prefix)
    miss = make_req(fresh(30), rid="miss")
    short = make_req(short_prefix + fresh(10), rid="short")
    long = make_req(long_prefix + fresh(10), rid="long")
    queue = [miss, short, long]
    SchedulePolicy("lpm", pools.cache).calc_priority(queue)
    assert rids(queue) == ["long", "short", "miss"]
    assert [len(r.prefix_indices) for r in queue] == [100, 40, 0]  # matches are fresh
    assert long.extend_input_len == 10


def test_lpm_defers_the_second_request_sharing_an_uncached_prefix():
    pools = Pools()
    shared = fresh(100)
    first = make_req(shared + fresh(5), rid="first")
    second = make_req(shared + fresh(5), rid="second")
    other = make_req(fresh(50), rid="other")
    queue = [first, second, other]
    SchedulePolicy("lpm", pools.cache).calc_priority(queue)
    assert rids(queue) == ["first", "other", "second"]


def test_lpm_does_not_defer_sharers_when_the_shared_part_is_already_cached():
    pools = Pools()
    shared = fresh(100)
    pools.cache_seq(shared)
    first = make_req(shared + fresh(5), rid="first")
    second = make_req(shared + fresh(5), rid="second")
    other = make_req(fresh(50), rid="other")
    queue = [other, first, second]
    SchedulePolicy("lpm", pools.cache).calc_priority(queue)
    assert rids(queue) == ["first", "second", "other"]


def test_lpm_falls_back_to_fcfs_above_128_waiting():
    pools = Pools(size=4000)
    cached = fresh(50)
    pools.cache_seq(cached)

    def queue_of(n: int) -> List[Req]:
        return [make_req(fresh(3), rid=f"w{i}") for i in range(n - 1)] + [make_req(cached + [1], rid="hit")]

    small = queue_of(128)
    SchedulePolicy("lpm", pools.cache).calc_priority(small)
    assert small[0].rid == "hit"
    big = queue_of(129)
    expected = rids(big)
    SchedulePolicy("lpm", pools.cache).calc_priority(big)
    assert rids(big) == expected
    assert len(big[-1].prefix_indices) == 0  # not even matched
    unlimited = queue_of(129)
    SchedulePolicy("lpm", pools.cache, enable_priority_fallback=False).calc_priority(unlimited)
    assert unlimited[0].rid == "hit"


@pytest.mark.parametrize("kind", ["chunk", "disabled"])
def test_cache_aware_policies_act_as_fcfs_when_the_cache_is_disabled(kind):
    pools = Pools(kind=kind)
    for policy in ("lpm", "dfs-weight"):
        reqs = [make_req(fresh(5) if i % 2 else [7, 7, 7, i], rid=f"d{i}") for i in range(5)]
        queue = list(reversed(reqs))
        SchedulePolicy(policy, pools.cache).calc_priority(queue)
        assert rids(queue) == [f"d{i}" for i in range(5)]


def test_dfs_weight_groups_requests_of_the_same_subtree_heaviest_first():
    pools = Pools()
    a, b = fresh(20), fresh(20)
    pools.cache_seq(a)
    pools.cache_seq(b)
    pools.cache_seq(a + fresh(10))  # a deeper branch under a
    deep = a + list(pools.cache.match_prefix(a).last_node.children.values())[0].key.token_ids
    order = [("b1", b), ("a1", a), ("miss", []), ("a2", a), ("b2", b), ("a3", deep)]
    queue = [make_req(prefix + fresh(4), rid=rid) for rid, prefix in order]
    SchedulePolicy("dfs-weight", pools.cache).calc_priority(queue)
    assert rids(queue) == ["a3", "a1", "a2", "b1", "b2", "miss"]


# -- PrefillAdder: the KV budget ---------------------------------------------------------------


def test_budget_admits_until_the_next_request_does_not_fit():
    pools = Pools(size=1000)
    pools.cache_seq(fresh(100))  # 900 free + 100 evictable = 1000
    adder = pools.adder()
    assert adder.rem_total_tokens == 1000
    results = [adder.add_one_req(ready(make_req(fresh(100), max_new=200), pools), False) for _ in range(4)]
    assert results == [AddReqResult.CONTINUE] * 3 + [AddReqResult.NO_TOKEN]
    assert len(adder.can_run_list) == 3
    assert adder.rem_total_tokens == 1000 - 3 * 300
    assert adder.log_input_tokens == 300


def test_a_request_that_exactly_fills_the_budget_is_admitted_and_ends_the_round():
    pools = Pools(size=1000)
    adder = pools.adder()
    result = adder.add_one_req(ready(make_req(fresh(400), max_new=600), pools), False)
    assert result is AddReqResult.OTHER
    assert len(adder.can_run_list) == 1 and adder.rem_total_tokens == 0


def test_running_requests_reserve_their_remaining_decode_tokens_times_the_ratio():
    pools = Pools(size=8000)
    running = [make_req(fresh(5), max_new=1000, output=200), make_req(fresh(5), max_new=100_000)]
    adder = pools.adder(running=running, ratio=0.5)
    assert adder.rem_total_tokens == 8000 - 0.5 * (800 + CLIP_MAX_NEW_TOKENS)


def test_decode_reservation_of_a_new_request_is_clipped():
    pools = Pools(size=8000)
    adder = pools.adder()
    assert adder.add_one_req(ready(make_req(fresh(10), max_new=1_000_000), pools), False) is AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 8000 - 10 - CLIP_MAX_NEW_TOKENS


def test_paged_cost_is_prompt_plus_decode_rounded_up_to_whole_pages():
    pools = Pools(size=256, page_size=4)
    adder = pools.adder()
    adder.add_one_req(ready(make_req(fresh(10), max_new=2), pools), False)
    assert adder.rem_total_tokens == 256 - 12  # the 2 decode tokens fit the prompt's last page
    adder.add_one_req(ready(make_req(fresh(10), max_new=3), pools), False)
    assert adder.rem_total_tokens == 256 - 12 - 16


def test_lone_paged_request_clamped_to_the_pool_is_admitted():
    """Regression: ceil_page(prompt) + decode overcounted, and a lone request whose prompt + clamped
    max_new_tokens filled the pool exactly waited forever."""
    pools = Pools(size=256, page_size=16)
    adder = pools.adder()
    assert adder.add_one_req(ready(make_req(fresh(200), max_new=54), pools), False) != AddReqResult.NO_TOKEN
    assert adder.can_run_list and adder.rem_total_tokens == 0


# -- PrefillAdder: locks ----------------------------------------------------------------------


def test_admission_locks_the_matched_prefix_and_keeps_the_tree_total():
    pools = Pools(size=1000)
    prefix = fresh(100)
    pools.cache_seq(prefix)
    req = ready(make_req(prefix + fresh(20), max_new=30), pools)
    adder = pools.adder()
    assert adder.add_one_req(req, False) is AddReqResult.CONTINUE
    assert pools.cache.protected_size() == 100 and pools.cache.evictable_size() == 0
    assert req.cache_protected_len == 100 and adder.log_hit_tokens == 100
    # The locked prefix no longer counts as evictable: only the free slots and the cost remain.
    assert adder.rem_total_tokens == 900 - (20 + 30)
    pools.cache.check_invariants()


def test_a_request_that_fits_only_while_its_prefix_is_evictable_is_refused_and_unlocked():
    pools = Pools(size=1000)
    prefix = fresh(100)
    pools.cache_seq(prefix)
    req = ready(make_req(prefix + fresh(50), max_new=900), pools)  # cost 950: <= 1000, > 900
    adder = pools.adder()
    assert adder.add_one_req(req, False) is AddReqResult.NO_TOKEN
    assert adder.can_run_list == []
    assert pools.cache.protected_size() == 0 and pools.cache.evictable_size() == 100
    assert adder.rem_total_tokens == 1000
    pools.cache.check_invariants()


def test_no_running_slot_left_means_other_and_no_lock():
    pools = Pools()
    prefix = fresh(30)
    pools.cache_seq(prefix)
    adder = pools.adder(slots=0)
    assert adder.add_one_req(ready(make_req(prefix + [1]), pools), False) is AddReqResult.OTHER
    assert adder.can_run_list == [] and pools.cache.protected_size() == 0


def test_taking_the_last_running_slot_admits_and_ends_the_round():
    pools = Pools()
    adder = pools.adder(slots=1)
    assert adder.add_one_req(ready(make_req(fresh(5)), pools), False) is AddReqResult.OTHER
    assert len(adder.can_run_list) == 1


# -- PrefillAdder: --max-prefill-tokens -------------------------------------------------------


def test_max_prefill_tokens_never_blocks_the_first_request():
    pools = Pools(size=1000)
    adder = pools.adder(max_prefill=50)
    big = ready(make_req(fresh(80)), pools)
    assert adder.add_one_req(big, False) is AddReqResult.OTHER  # admitted; the cap is used up
    assert adder.can_run_list == [big] and big.extend_input_len == 80


def test_max_prefill_tokens_blocks_a_later_request_that_exceeds_what_is_left():
    pools = Pools(size=1000)
    adder = pools.adder(max_prefill=100)
    assert adder.add_one_req(ready(make_req(fresh(60)), pools), False) is AddReqResult.CONTINUE
    assert adder.add_one_req(ready(make_req(fresh(50)), pools), False) is AddReqResult.OTHER
    assert len(adder.can_run_list) == 1
    assert adder.add_one_req(ready(make_req(fresh(40)), pools), False) is AddReqResult.OTHER  # exactly fills it
    assert len(adder.can_run_list) == 2


# -- PrefillAdder: chunked prefill ------------------------------------------------------------


def test_chunking_splits_a_long_prompt_into_page_aligned_chunks_until_the_last_one():
    pools = Pools(size=256, page_size=4)
    req = make_req(fresh(30), max_new=5)
    adder = pools.adder(chunk=10)
    assert adder.add_one_req(ready(req, pools), has_chunked_req=False) is AddReqResult.OTHER
    assert adder.new_chunked_req is req and adder.can_run_list == [req]
    assert req.extend_input_len == 8 and len(req.fill_ids) == 8
    chunks, prefixes = [8], [0]
    pools.prefill(req)
    check_kv_conservation(pools.cache, pools.alloc, pools.req_pool, [req])
    while True:
        adder = pools.adder(chunk=10)
        prefixes.append(len(req.prefix_indices))
        still = adder.add_chunked_req(req)
        chunks.append(req.extend_input_len)
        assert adder.can_run_list == [req]
        assert len(req.fill_ids) == prefixes[-1] + chunks[-1]
        if still is None:
            assert adder.new_chunked_req is None
            break
        assert still is req and adder.new_chunked_req is req
        pools.prefill(req)
        check_kv_conservation(pools.cache, pools.alloc, pools.req_pool, [req])
    assert chunks == [8, 8, 8, 6] and prefixes == [0, 8, 16, 24]
    assert req.fill_ids == req.origin_input_ids


def test_a_chunked_request_reserves_its_whole_prompt_and_decode_tokens():
    pools = Pools(size=1000)
    adder = pools.adder(chunk=64)
    adder.add_one_req(ready(make_req(fresh(300), max_new=50), pools), False)
    assert adder.rem_total_tokens == 1000 - 300 - 50
    assert adder.log_input_tokens == 64 and adder.rem_chunk_tokens == 0


def test_chunking_uses_what_is_left_of_the_chunk_budget_after_earlier_requests():
    pools = Pools(size=1000)
    adder = pools.adder(chunk=10)
    assert adder.add_one_req(ready(make_req(fresh(4)), pools), False) is AddReqResult.CONTINUE
    long = ready(make_req(fresh(30)), pools)
    assert adder.add_one_req(long, False) is AddReqResult.OTHER
    assert adder.new_chunked_req is long and long.extend_input_len == 6


def test_only_one_chunked_request_at_a_time():
    pools = Pools(size=1000)
    in_flight = ready(make_req(fresh(50)), pools)
    pools.adder(chunk=16).add_one_req(in_flight, False)
    pools.prefill(in_flight)

    adder = pools.adder(chunk=16)
    assert adder.add_chunked_req(in_flight) is in_flight  # 16 more of 50; budget used up
    small = ready(make_req(fresh(3)), pools)
    assert adder.add_one_req(small, has_chunked_req=True) is AddReqResult.OTHER

    adder = pools.adder(chunk=100)  # a round with budget left after the chunk
    assert adder.add_chunked_req(in_flight) is None  # last 18 tokens
    assert adder.add_one_req(small, has_chunked_req=True) is AddReqResult.CONTINUE
    long = ready(make_req(fresh(200)), pools)
    assert adder.add_one_req(long, has_chunked_req=True) is AddReqResult.OTHER
    assert adder.can_run_list == [in_flight, small] and adder.new_chunked_req is None
    assert long.extend_input_len == 200  # untouched when refused


def test_a_new_chunked_request_blocks_a_second_one_in_the_same_round():
    pools = Pools(size=1000)
    adder = pools.adder(chunk=40)
    first, second = ready(make_req(fresh(20)), pools), ready(make_req(fresh(100)), pools)
    adder.add_one_req(first, False)
    adder.add_one_req(second, False)
    third = ready(make_req(fresh(100)), pools)
    assert adder.add_one_req(third, False) is AddReqResult.OTHER
    assert adder.can_run_list == [first, second] and adder.new_chunked_req is second


def test_chunking_off_admits_a_first_request_larger_than_max_prefill_whole():
    pools = Pools(size=1000)
    for chunk in (None, -1):
        adder = pools.adder(max_prefill=64, chunk=chunk)
        req = ready(make_req(fresh(300)), pools)
        adder.add_one_req(req, False)
        assert adder.can_run_list == [req] and req.extend_input_len == 300
        assert adder.new_chunked_req is None and adder.rem_chunk_tokens is None
        pools.cache.dec_lock_ref(req.last_node)


def test_chunk_cache_continues_a_chunked_request_from_its_own_slots():
    pools = Pools(size=256, kind="chunk")
    req = ready(make_req(fresh(40), max_new=4), pools)
    pools.adder(chunk=16).add_one_req(req, False)
    pools.prefill(req)
    adder = pools.adder(chunk=16)
    assert adder.add_chunked_req(req) is req
    assert len(req.prefix_indices) == 16 and req.extend_input_len == 16
    assert adder.rem_total_tokens == 256 - 16 - (40 - 16) - 4
