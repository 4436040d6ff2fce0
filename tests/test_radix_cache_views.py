"""Zero-copy inserts and the lazy eviction heap: node values as views of the caller's tensor
(never of a `req_to_token` row), node keys as windows on the caller's token list, inserts that
start at a request's locked `last_node`, and eviction order and slot conservation."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache, RadixKey
from test_cache_req_helpers import Harness


def leaves(cache: RadixCache) -> list:
    return [n for n in cache.iter_nodes() if not n.children]


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# -- values: views where safe ----------------------------------------------------------------------


def test_insert_keeps_a_view_of_an_owned_int64_value():
    cache = RadixCache(None, TokenToKVPoolAllocator(64))
    value = torch.arange(10, 16)
    cache.insert([1, 2, 3, 4, 5, 6], value)
    (leaf,) = leaves(cache)
    assert shares_memory(leaf.value, value) and leaf.value.tolist() == value.tolist()


def test_insert_keeps_a_view_of_the_new_span_only():
    cache = RadixCache(None, TokenToKVPoolAllocator(64))
    cache.insert([1, 2], torch.tensor([7, 8]))
    value = torch.tensor([30, 31, 32, 33])
    assert cache.insert([1, 2, 3, 4], value) == 2
    leaf = cache.match_prefix([1, 2, 3, 4]).last_node
    assert leaf.value.tolist() == [32, 33] and shares_memory(leaf.value, value)


def test_a_value_of_another_dtype_is_converted_into_a_copy():
    cache = RadixCache(None, TokenToKVPoolAllocator(64))
    value = torch.tensor([4, 5, 6], dtype=torch.int32)
    cache.insert([1, 2, 3], value)
    (leaf,) = leaves(cache)
    assert leaf.value.dtype == torch.int64 and not shares_memory(leaf.value, value)


def test_a_view_that_would_pin_a_much_larger_tensor_is_copied():
    cache = RadixCache(None, TokenToKVPoolAllocator(1 << 16))
    ids = list(range(1, 20001))
    cache.insert(ids[:19990], torch.arange(1, 19991))
    big = torch.arange(100_000, 120_000)
    assert cache.insert(ids, big) == 19990
    leaf = cache.match_prefix(ids).last_node
    assert leaf.value.tolist() == big[19990:].tolist() and not shares_memory(leaf.value, big)


def test_a_view_of_req_to_token_is_copied_so_reusing_the_row_cannot_change_the_tree():
    rows = torch.zeros((2, 8), dtype=torch.int64)  # an int64 table: `.to(int64)` would not copy
    pool = SimpleNamespace(req_to_token=rows)
    cache = RadixCache(pool, TokenToKVPoolAllocator(64))
    rows[0, :4] = torch.tensor([11, 12, 13, 14])
    cache.insert([1, 2, 3, 4], rows[0, :4])
    rows[0, :4] = torch.tensor([51, 52, 53, 54])  # the row goes to another request
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [11, 12, 13, 14]
    cache.check_invariants()


def test_the_invariant_checker_catches_a_node_value_aliasing_req_to_token():
    rows = torch.zeros((2, 8), dtype=torch.int64)
    cache = RadixCache(SimpleNamespace(req_to_token=rows), None)
    cache.insert([1, 2, 3, 4], torch.tensor([1, 2, 3, 4]))
    leaves(cache)[0].value = rows[1, :4]
    with pytest.raises(AssertionError, match="req_to_token"):
        cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_slots_stay_correct_after_the_finished_requests_row_is_reused(page_size):
    h = Harness(page_size=page_size, pool_tokens=256, rows=1)  # one row: every request reuses it
    h.run(list(range(1, 19)), [40, 41, 42])
    before = {n.id: n.value.tolist() for n in h.cache.iter_nodes()}
    assert all(not shares_memory(n.value, h.req_pool.req_to_token) for n in h.cache.iter_nodes())
    req = h.admit(list(range(100, 130)))  # a different prompt takes row 0 and overwrites it
    assert h.extend(req, 30)
    assert {n.id: n.value.tolist() for n in h.cache.iter_nodes() if n.id in before} == before
    h.finish(req)
    h.check()


def test_unfinished_then_finished_request_leaves_each_slot_with_one_owner():
    h = Harness(page_size=2, pool_tokens=128)
    req = h.admit(list(range(1, 21)))
    for _ in range(4):  # four prefill chunks of 5 tokens
        assert h.extend(req, 5)
        h.cache.cache_unfinished_req(req)
        h.check()
        assert req.prefix_indices.tolist() == h.req_pool.req_to_token[req.req_pool_idx, : req.kv_committed_len].tolist()
    h.finish(req)
    h.check()
    assert h.alloc.available_size() + h.cache.total_size() == 128


# -- keys: windows, packed lazily ------------------------------------------------------------------


def test_a_new_leaf_is_a_window_that_packs_nothing_until_compared():
    cache = RadixCache(None, None)
    ids = list(range(1, 5001))
    cache.insert(ids)
    (leaf,) = leaves(cache)
    assert leaf.key.fixed and leaf.key.num_packed == 0
    assert len(cache.match_prefix(list(ids)).device_indices) == 5000
    assert leaf.key.num_packed == 5000 and leaf.key._ids is None  # packed once, list released


def test_appending_to_the_inserted_list_does_not_change_the_tree():
    cache = RadixCache(None, None)
    ids = [1, 2, 3]
    cache.insert(ids)
    ids.append(4)
    assert len(leaves(cache)[0].key) == 3 and cache.total_size() == 3
    assert len(cache.match_prefix([1, 2, 3, 4]).device_indices) == 3
    cache.check_invariants()


def test_a_slice_of_a_growing_key_is_fixed():
    ids = [1, 2, 3, 4]
    key = RadixKey(ids)
    part = key[1:3]
    ids.extend([5, 6])
    assert len(key) == 6 and not key.fixed
    assert len(part) == 2 and part.fixed and part.token_ids == [2, 3] and part[1] == 3


def test_a_fixed_key_keeps_the_ids_of_its_list_at_creation():
    ids = [1, 2, 3, 4]
    key = RadixKey(ids, fixed=True)
    ids.extend([5, 6])
    assert len(key) == 4 and key.fixed and key.token_ids == [1, 2, 3, 4]
    assert key.window(0, 4) is key  # all of a fixed key: the key itself, nothing copied
    assert key.window(0, 3) is not key and key.window(0, 3).token_ids == [1, 2, 3]
    growing = RadixKey(ids)
    assert growing.window(0, 6) is not growing  # a growing key's window must be a new, fixed key


@pytest.mark.parametrize("page", [1, 4])
def test_packed_and_list_keys_find_the_same_child(page):
    # Children are looked up by the page's ids, whether the key holds a list or only bytes.
    alloc = PagedTokenToKVPoolAllocator(256, page) if page > 1 else TokenToKVPoolAllocator(256)
    cache = RadixCache(None, alloc, page_size=page)
    ids = [7, 8, 9, 10, 11, 12, 13, 14]
    slots = alloc.alloc(8)
    assert cache.insert(ids, slots) == 0
    found = cache.match_prefix(RadixKey.from_packed(array("i", ids).tobytes()))
    assert torch.equal(found.device_indices, slots)
    assert len(cache.match_prefix(RadixKey(ids, extra_key="other")).device_indices) == 0
    miss = RadixKey([99] * 4096)
    assert len(cache.match_prefix(miss).device_indices) == 0 and miss.num_packed == 0  # a miss packs nothing
    cache.check_invariants()
    assert cache.evict(8) == 8 and cache.total_size() == 0
    assert alloc.available_size() == 256  # every slot is back with the allocator


def test_a_split_of_an_unpacked_node_keeps_both_halves_exact():
    cache = RadixCache(None, None)
    ids = [random.Random(0).randrange(1000) for _ in range(3000)]
    cache.insert(ids)
    fork = ids[:1500] + [1001]
    assert len(cache.match_prefix(fork).device_indices) == 1500
    assert sorted(len(n.key) for n in cache.iter_nodes()) == [1500, 1500]
    assert cache.match_prefix(ids).device_indices.tolist() == ids
    cache.check_invariants()


# -- request helpers start at the locked last_node -------------------------------------------------


def test_finishing_touches_the_whole_path_like_a_walk_from_the_root():
    h = Harness()
    h.run([1, 2, 3, 4, 5, 6], [7])
    h.run([9, 9, 9], [9])
    req = h.admit([1, 2, 3, 4, 5, 6, 8])  # locks the 6-token node, made by the first request
    assert h.extend(req, 1)
    h.finish(req)
    path = [n for n in h.cache.iter_nodes() if n.key.token_ids[0] in (1, 8)]
    assert len({n.last_access_time for n in path}) == 1  # one tick for the whole path
    assert h.cache.evict(1) == 3  # so [9, 9, 9] is the least recently used
    h.check()


def test_a_last_node_that_does_not_cover_the_protected_length_is_refused():
    h = Harness()
    h.run([1, 2, 3, 4, 5], [6])
    req = h.admit([1, 2, 3, 4, 5, 6, 7])
    req.cache_protected_len -= 1  # corrupt: the lock covers 5 tokens, the request claims 4
    with pytest.raises(AssertionError, match="last_node covers"):
        h.cache.cache_finished_req(req)


# -- eviction ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_evicting_one_token_at_a_time_frees_leaves_in_exact_policy_order(policy):
    rng = random.Random(1)
    cache = RadixCache(None, TokenToKVPoolAllocator(4096), eviction_policy=policy)
    seqs = [[g, rng.randrange(1, 50), i] for g in range(1, 9) for i in range(1, 5)]
    for s in seqs:
        slots = cache.token_to_kv_pool_allocator.alloc(3)
        cache.token_to_kv_pool_allocator.free(slots[: cache.insert(s, slots)])
    for s in rng.choices(seqs, k=40):
        cache.match_prefix(s[: rng.randrange(1, 4)])
    order = (lambda n: (n.last_access_time, n.id)) if policy == "lru" else (lambda n: (n.hit_count, n.last_access_time, n.id))
    while cache.total_size():
        expected = min((n for n in leaves(cache) if n.lock_ref == 0), key=order)
        assert cache.evict(1) == len(expected.key) and expected.evicted
        cache.check_invariants()
        if cache.total_size():  # touch a filed leaf: its heap entry goes stale
            path = []
            node = rng.choice(leaves(cache))
            while node is not cache.root:
                path, node = node.key.token_ids + path, node.parent
            cache.match_prefix(path)


def test_a_leaf_locked_before_the_next_eviction_is_not_evicted():
    cache = RadixCache(None, TokenToKVPoolAllocator(64))
    cache.insert([1, 2], torch.tensor([1, 2]))
    cache.insert([3, 4], torch.tensor([3, 4]))  # both only noted for the heap so far
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    assert cache.evict(10) == 2 and cache.match_prefix([1, 2]).device_indices.tolist() == [1, 2]
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_available_plus_evictable_plus_protected_is_the_pool_after_random_traffic(page_size):
    rng = random.Random(page_size)
    pool = 512
    alloc = TokenToKVPoolAllocator(pool) if page_size == 1 else PagedTokenToKVPoolAllocator(pool, page_size)
    cache = RadixCache(None, alloc, page_size=page_size)
    locked = []
    for step in range(300):
        seq = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 40))]
        seq = seq[: len(seq) - len(seq) % page_size]
        if not seq:
            continue
        need = len(seq)
        if alloc.available_size() < need:
            cache.evict(need - alloc.available_size())
        slots = alloc.alloc(need)
        if slots is None:
            continue
        alloc.free(slots[: cache.insert(seq, slots)])
        if rng.random() < 0.2:
            node = cache.match_prefix(seq).last_node
            cache.inc_lock_ref(node)
            locked.append(node)
        if locked and rng.random() < 0.2:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == pool
        if step % 50 == 0:
            cache.check_invariants()
    for node in locked:
        cache.dec_lock_ref(node)
    cache.evict(pool)
    assert alloc.available_size() == pool and cache.total_size() == 0
