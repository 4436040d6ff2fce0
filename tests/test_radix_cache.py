"""Unit tests of the radix prefix cache: match, insert, split, namespaces, locks, eviction,
pages, reset, disable, and the invariant checker."""

from __future__ import annotations

import pytest
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.chunk_cache import ChunkCache
from mem_cache.radix_cache import RadixCache, RadixKey


def make_cache(page_size: int = 1, size: int = 512, policy: str = "lru") -> RadixCache:
    alloc = TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size)
    return RadixCache(None, alloc, page_size=page_size, eviction_policy=policy)


def put(cache: RadixCache, tokens, extra_key=None) -> torch.Tensor:
    """Insert `tokens` with freshly allocated slots, freeing what the tree does not adopt
    (duplicates and unaligned tail), like `cache_finished_req`. Returns the slots used."""
    P = cache.page_size
    alloc = cache.token_to_kv_pool_allocator
    slots = alloc.alloc(-(-len(tokens) // P) * P)[: len(tokens)]
    prefix = cache.insert(RadixKey(list(tokens), extra_key), slots)
    aligned = len(tokens) - len(tokens) % P
    alloc.free(torch.cat((slots[:prefix], slots[aligned:])))
    return slots


def tree_only() -> RadixCache:
    return RadixCache(None, None)


# -- match / insert / split ----------------------------------------------------------------------


def test_insert_returns_the_length_already_present():
    cache = tree_only()
    assert cache.insert([1, 2, 3, 4]) == 0
    assert cache.insert([1, 2, 3, 4, 5, 6]) == 4
    assert cache.insert([1, 2, 9]) == 2
    assert cache.insert([1, 2, 3, 4]) == 4
    assert cache.total_size() == 7


def test_match_full_and_partial_return_the_inserted_values():
    cache = tree_only()
    cache.insert([1, 2, 3, 4], torch.tensor([10, 20, 30, 40]))
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30, 40]
    assert cache.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == [10, 20, 30, 40]
    assert cache.match_prefix([1, 2, 7]).device_indices.tolist() == [10, 20]
    assert cache.match_prefix([5, 1]).device_indices.tolist() == []
    assert cache.match_prefix([]).last_node is cache.root


def test_match_ending_inside_a_node_splits_it_and_keeps_total_size():
    cache = tree_only()
    cache.insert([1, 2, 3, 4, 5])
    nodes_before = len(cache.iter_nodes())
    result = cache.match_prefix([1, 2, 3])
    assert len(cache.iter_nodes()) == nodes_before + 1
    assert cache.total_size() == 5
    assert result.last_node.key.token_ids == [1, 2, 3]
    assert [n.key.token_ids for n in result.last_node.children.values()] == [[4, 5]]
    cache.check_invariants()


def test_match_after_split_returns_the_full_original_values():
    cache = tree_only()
    cache.insert([1, 2, 3, 4, 5], torch.tensor([11, 12, 13, 14, 15]))
    cache.match_prefix([1, 2, 9])
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [11, 12, 13, 14, 15]


def test_insert_diverging_inside_a_node_splits_and_keeps_older_values():
    cache = tree_only()
    cache.insert([1, 2, 3, 4], torch.tensor([11, 12, 13, 14]))
    assert cache.insert([1, 2, 8, 9], torch.tensor([91, 92, 98, 99])) == 2
    assert cache.match_prefix([1, 2, 8, 9]).device_indices.tolist() == [11, 12, 98, 99]
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [11, 12, 13, 14]
    cache.check_invariants()


def test_long_keys_diverging_anywhere_match_exactly():
    cache = tree_only()
    base = list(range(1000, 5096))
    cache.insert(base)
    for cut in (1, 2, 777, 2048, 4095):
        fork = base[:cut] + [7] * 10
        assert len(cache.match_prefix(fork).device_indices) == cut
    cache.check_invariants()


def test_insert_rejects_a_value_of_the_wrong_length():
    with pytest.raises(ValueError):
        tree_only().insert([1, 2, 3], torch.tensor([1, 2]))


def test_radix_key_slicing_keeps_extra_key():
    key = RadixKey([1, 2, 3, 4], extra_key="salt")
    part = key[1:3]
    assert part.token_ids == [2, 3] and part.extra_key == "salt"
    assert RadixKey.from_packed(key.packed, "salt")[2:].token_ids == [3, 4]
    assert key[0] == 1 and len(key) == 4 and list(key) == [1, 2, 3, 4]


def test_radix_key_packs_lazily_and_slices_consistently():
    ids = list(range(1000, 2000))
    key = RadixKey(ids)
    key.packed_upto(10)
    assert 10 * 4 <= len(key._packed) < 1000 * 4  # only a prefix is packed so far
    assert key[5:500].packed == RadixKey(ids[5:500]).packed
    assert key[700:900].packed == RadixKey(ids[700:900]).packed  # starts beyond the packed prefix
    assert key.packed == RadixKey(ids).packed and len(key.packed) == 4000


def test_a_miss_packs_only_the_start_of_a_long_key():
    cache = tree_only()
    cache.insert([1, 2, 3])
    key = RadixKey([7] * 32768)
    assert len(cache.match_prefix(key).device_indices) == 0
    assert len(key._packed) <= 64 * 4  # cost follows the matched length, not the key length


def test_token_ids_outside_int32_are_refused_when_compared():
    # Child lookups read ids without packing them (a miss at the root packs nothing); a span
    # that is compared is packed, and an id outside int32 is refused there, not wrapped.
    cache = tree_only()
    cache.insert([1, 2, 3])
    with pytest.raises(ValueError, match="int32"):
        cache.match_prefix([1, 2**31])
    with pytest.raises(ValueError, match="int32"):
        cache.insert([1, -(2**31) - 1, 3])
    assert len(cache.match_prefix([1, 2, 3]).device_indices) == 3  # the tree is unharmed
    cache.check_invariants()


# -- namespaces ----------------------------------------------------------------------------------


def test_namespaces_never_share_nodes():
    cache = tree_only()
    cache.insert(RadixKey([1, 2, 3], extra_key="a"))
    assert len(cache.match_prefix(RadixKey([1, 2, 3], extra_key="b")).device_indices) == 0
    assert len(cache.match_prefix([1, 2, 3]).device_indices) == 0
    assert len(cache.match_prefix(RadixKey([1, 2, 3], extra_key="a")).device_indices) == 3
    assert cache.insert(RadixKey([1, 2, 3], extra_key="b")) == 0
    assert cache.total_size() == 6
    cache.check_invariants()


# -- locks ---------------------------------------------------------------------------------------


def test_lock_moves_path_tokens_to_protected_and_back():
    cache = tree_only()
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 7])
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert cache.inc_lock_ref(node) == -4
    assert (cache.evictable_size(), cache.protected_size()) == (1, 4)
    assert cache.inc_lock_ref(node) == 0  # second lock: nothing moves
    assert cache.dec_lock_ref(node) == 0
    assert cache.dec_lock_ref(node) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    cache.check_invariants()


def test_unlocking_an_unlocked_node_raises():
    cache = tree_only()
    cache.insert([1, 2])
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(cache.match_prefix([1, 2]).last_node)


def test_split_copies_lock_ref_so_accounting_stays_exact():
    cache = tree_only()
    cache.insert([1, 2, 3, 4])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3, 4]).last_node)
    upper = cache.match_prefix([1, 2]).last_node
    assert upper.lock_ref == 1 and cache.protected_size() == 4
    cache.check_invariants()


def test_root_is_permanently_locked_and_locking_it_is_a_no_op():
    cache = tree_only()
    assert cache.root.lock_ref == 1
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0
    assert cache.root.lock_ref == 1


# -- eviction ------------------------------------------------------------------------------------


def test_evict_returns_slots_to_the_allocator():
    cache = make_cache(size=64)
    slots = put(cache, [1, 2, 3, 4])
    alloc = cache.token_to_kv_pool_allocator
    assert alloc.available_size() == 60
    assert cache.evict(4) == 4
    assert alloc.available_size() == 64 and cache.total_size() == 0
    assert set(slots.tolist()) <= set(alloc.free_slots.tolist())


def test_evict_never_touches_a_locked_path():
    cache = make_cache(size=64)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5, 6])
    put(cache, [9, 9])
    locked = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(locked.last_node)
    assert cache.evict(100) == 4  # [5, 6] and [9, 9]
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == locked.device_indices.tolist()
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.check_invariants()


def cached_first_tokens(cache: RadixCache) -> list:
    """First tokens of the root's children (reads the tree without touching access times)."""
    return sorted(child.key.token_ids[0] for child in cache.root.children.values())


def test_evict_is_least_recently_used_first():
    cache = make_cache(size=64)
    for first in (1, 2, 3):
        put(cache, [first, 0, 0])
    cache.match_prefix([1, 0, 0])  # 1 is now the most recent
    cache.evict(3)
    assert cached_first_tokens(cache) == [1, 3]
    cache.evict(3)
    assert cached_first_tokens(cache) == [1]


def test_lfu_evicts_fewest_hits_first_then_least_recent():
    cache = make_cache(size=64, policy="lfu")
    for first in (1, 2, 3):
        put(cache, [first, 0])
    for _ in range(3):
        cache.match_prefix([1, 0])
    cache.match_prefix([2, 0])
    cache.match_prefix([3, 0])  # 2 and 3 have one hit each; 2 is older
    cache.evict(2)
    assert cached_first_tokens(cache) == [1, 3]
    cache.evict(2)
    assert cached_first_tokens(cache) == [1]


def test_parent_joins_the_heap_when_its_last_child_is_evicted():
    cache = make_cache(size=64)
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 3, 4, 5])
    assert cache.evict(1) == 2  # the leaf [4, 5]
    assert cache.total_size() == 3
    assert cache.evict(1) == 3  # its parent, now an unlocked leaf
    assert cache.total_size() == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 64


def test_evict_overshoots_by_at_most_one_node():
    cache = make_cache(size=64)
    put(cache, list(range(1, 11)))
    assert cache.evict(1) == 10


def test_unknown_eviction_policy_is_refused():
    with pytest.raises(ValueError, match="lru"):
        make_cache(policy="fifo")


# -- pages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_paged_matches_are_whole_pages(page_size):
    cache = make_cache(page_size=page_size, size=1024)
    seq = [(7 * i) % 11 + 1 for i in range(50)]
    put(cache, seq)
    assert cache.total_size() == 50 - 50 % page_size
    for n in range(0, 51):
        query = seq[:n] + [99]
        got = len(cache.match_prefix(query).device_indices)
        assert got == min(n, 50) - min(n, 50) % page_size
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [2, 4, 16])
def test_paged_split_happens_only_at_page_boundaries(page_size):
    cache = make_cache(page_size=page_size, size=1024)
    seq = list(range(1, 3 * page_size + 1))
    put(cache, seq)
    fork = seq[: page_size + 1] + [0] * (2 * page_size)  # diverges one token into page 2
    put(cache, fork)
    for node in cache.iter_nodes():
        assert len(node.key) % page_size == 0
    assert len(cache.match_prefix(fork).device_indices) == 3 * page_size
    assert len(cache.match_prefix(seq).device_indices) == 3 * page_size
    cache.check_invariants()


def test_paged_key_shorter_than_a_page_is_not_stored():
    cache = make_cache(page_size=4)
    assert cache.insert([1, 2, 3], torch.tensor([4, 5, 6])) == 0
    assert cache.total_size() == 0 and len(cache.match_prefix([1, 2, 3]).device_indices) == 0


def test_page_size_must_match_the_allocator():
    with pytest.raises(ValueError, match="page_size"):
        RadixCache(None, PagedTokenToKVPoolAllocator(64, 4), page_size=2)


# -- reset / disable -----------------------------------------------------------------------------


def test_reset_empties_everything_and_returns_slots():
    cache = make_cache(size=64)
    put(cache, [1, 2, 3])
    put(cache, [1, 5])
    cache.reset()
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert not cache.root.children and len(cache.match_prefix([1, 2, 3]).device_indices) == 0
    assert cache.token_to_kv_pool_allocator.available_size() == 64
    cache.check_invariants()


def test_reset_refuses_while_a_request_holds_a_lock():
    cache = make_cache(size=64)
    put(cache, [1, 2, 3])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3]).last_node)
    with pytest.raises(ValueError, match="locked"):
        cache.reset()


@pytest.mark.parametrize("factory", [lambda: RadixCache(None, None, disable=True), lambda: ChunkCache(None, None)])
def test_a_disabled_cache_never_hits(factory):
    cache = factory()
    assert cache.insert([1, 2, 3], torch.tensor([1, 2, 3])) == 0
    result = cache.match_prefix([1, 2, 3])
    assert len(result.device_indices) == 0
    assert cache.inc_lock_ref(result.last_node) == 0 and cache.dec_lock_ref(result.last_node) == 0
    assert cache.evict(10) == 0 and cache.total_size() == 0
    cache.check_invariants()


def test_pretty_print_shows_keys_and_locks():
    cache = tree_only()
    cache.insert([1, 2, 3])
    text = cache.pretty_print()
    assert "[1, 2, 3]" in text and "lock_ref=0" in text


# -- the invariant checker catches corruption -----------------------------------------------------


def _two_level_tree(page_size: int = 1) -> RadixCache:
    cache = make_cache(page_size=page_size, size=256)
    put(cache, list(range(1, 4 * page_size + 1)))
    put(cache, list(range(1, 2 * page_size + 1)) + [99] * (2 * page_size))
    cache.check_invariants()
    return cache


def _a_leaf(cache: RadixCache):
    return next(n for n in cache.iter_nodes() if not n.children)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda c: setattr(c, "_evictable", c._evictable + 1), "evictable_size"),
        (lambda c: setattr(c, "_protected", 3), "protected_size"),
        (lambda c: setattr(_a_leaf(c), "parent", c.root), "parent link"),
        (lambda c: setattr(_a_leaf(c), "value", _a_leaf(c).value[:-1]), "value length"),
        (lambda c: setattr(_a_leaf(c), "lock_ref", -1), "negative lock_ref"),
        (lambda c: setattr(_a_leaf(c), "in_heap", False), "eviction heap"),
        (lambda c: setattr(_a_leaf(c), "key", RadixKey([5] * len(_a_leaf(c).key))), "child key"),
        (lambda c: setattr(c.root, "lock_ref", 2), "root lock_ref"),
    ],
)
def test_check_invariants_names_the_corruption(corrupt, message):
    cache = _two_level_tree()
    corrupt(cache)
    with pytest.raises(AssertionError, match=message):
        cache.check_invariants()


def test_check_invariants_catches_an_unaligned_key_when_paged():
    cache = _two_level_tree(page_size=4)
    leaf = _a_leaf(cache)
    leaf.key, leaf.value = leaf.key[:-1], leaf.value[:-1]
    with pytest.raises(AssertionError, match="multiple of page_size"):
        cache.check_invariants()


def test_check_invariants_catches_a_slot_held_twice():
    cache = _two_level_tree()
    leaves = [n for n in cache.iter_nodes() if not n.children]
    leaves[0].value = leaves[1].value[: len(leaves[0].value)].clone()
    with pytest.raises(AssertionError, match="two tree positions"):
        cache.check_invariants()
