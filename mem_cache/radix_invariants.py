"""`check_radix_invariants`: a full consistency check of a `RadixCache` (tests, idle checks).

It walks the whole tree (O(tokens)), so it is for tests and the scheduler's idle-time leak
check, never for the per-request path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, List

import torch

from mem_cache.radix_tree_node import TreeNode

if TYPE_CHECKING:
    from mem_cache.radix_cache import RadixCache


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(f"radix cache invariant violated: {message}")


def check_radix_invariants(cache: RadixCache) -> None:
    """Raise `AssertionError` naming the first inconsistency found.

    Checked: root shape and permanent lock; parent/child links; each child stored under the
    dict key derived from its own key (first token / first page, plus namespace); one namespace
    per subtree; non-empty, page-aligned, fixed-length keys; int64 1-D values as long as keys
    and never views of `req_to_token`; lock_ref >= 0 and at least the sum of the children's;
    evictable / protected sizes equal to the sums over unlocked / locked nodes; every unlocked
    leaf tracked by the eviction heap. With an allocator: no slot in two nodes, no dummy slot
    0, and (paged) each page of a value is one whole page.
    """
    root = cache.root
    _expect(root.parent is None, "root has a parent")
    _expect(len(root.key) == 0 and root.value.numel() == 0, "root holds tokens")
    _expect(root.lock_ref == 1, f"root lock_ref is {root.lock_ref}, expected the permanent 1")
    evictable = protected = 0
    values: List[torch.Tensor] = []
    stack = [root]
    while stack:
        node = stack.pop()
        child_locks = 0
        for dict_key, child in node.children.items():
            _check_child(cache, node, dict_key, child)
            child_locks += child.lock_ref
            if child.lock_ref > 0:
                protected += len(child.key)
            else:
                evictable += len(child.key)
            values.append(child.value)
            stack.append(child)
        if node is not root:
            _expect(
                node.lock_ref >= child_locks,
                f"node {node.id} lock_ref {node.lock_ref} < sum of its children's lock_ref {child_locks}",
            )
    _expect(evictable == cache.evictable_size(), f"evictable_size {cache.evictable_size()} != {evictable} in unlocked nodes")
    _expect(protected == cache.protected_size(), f"protected_size {cache.protected_size()} != {protected} in locked nodes")
    if cache.token_to_kv_pool_allocator is not None and values:
        _check_slots(torch.cat(values), cache.page_size)


def _check_child(cache: RadixCache, parent: TreeNode, dict_key: Hashable, child: TreeNode) -> None:
    cid = child.id
    _expect(child.parent is parent, f"node {cid}: parent link does not point to the node holding it")
    _expect(not child.evicted, f"node {cid} is marked evicted but still in the tree")
    n = len(child.key)
    _expect(n > 0, f"node {cid} has an empty key")
    _expect(n % cache.page_size == 0, f"node {cid}: key length {n} is not a multiple of page_size {cache.page_size}")
    expected_key = cache.child_key_of(child.key)
    _expect(dict_key == expected_key, f"node {cid} is stored under child key {dict_key!r} but its key starts {expected_key!r}")
    _expect(child.key.fixed, f"node {cid}: key follows a growing token list instead of a fixed window")
    if parent is not cache.root:
        _expect(
            child.key.extra_key == parent.key.extra_key,
            f"node {cid} namespace {child.key.extra_key!r} differs from its parent's {parent.key.extra_key!r}",
        )
    value = child.value
    _expect(value.dim() == 1 and value.dtype == torch.int64, f"node {cid}: value must be 1-D int64, got {value.dtype} {tuple(value.shape)}")
    _expect(len(value) == n, f"node {cid}: value length {len(value)} != key length {n}")
    rows = getattr(cache.req_to_token_pool, "req_to_token", None)
    _expect(
        rows is None or rows.untyped_storage().data_ptr() != value.untyped_storage().data_ptr(),
        f"node {cid}: value is a view of req_to_token (it would change when the row is reused)",
    )
    _expect(child.lock_ref >= 0, f"node {cid} has negative lock_ref {child.lock_ref}")
    if child.lock_ref == 0 and not child.children:
        _expect(child.in_heap, f"unlocked leaf {cid} is not tracked by the eviction heap (it could never be evicted)")


def _check_slots(slots: torch.Tensor, page_size: int) -> None:
    _expect(int(slots.min()) > 0, "the dummy slot 0 (page 0) is held by the tree")
    _expect(torch.unique(slots).numel() == slots.numel(), "a KV slot is held by two tree positions")
    if page_size > 1:
        pages = slots.view(-1, page_size)
        offsets = torch.arange(page_size, dtype=torch.int64, device=slots.device)
        whole = (pages % page_size == offsets).all() and (pages // page_size == pages[:, :1] // page_size).all()
        _expect(bool(whole), "a page-aligned span of a node value is not one whole KV page")


def check_kv_conservation(tree_cache: object, allocator: object, req_to_token_pool: object, live_reqs: list) -> None:
    """Every KV slot (page, when page_size P > 1) has exactly one owner, and nothing leaks.

    Owners: the allocator's free list, the tree's node values, and each live request's private
    range `req_to_token[row, cache_protected_len:kv_allocated_len]`. A request's private range
    may end mid-page but the allocator gave it the whole page, so it counts
    `ceil((kv_allocated_len - cache_protected_len) / P)` pages. Checks
    `available_size() + evictable + protected + sum(private pages) * P == allocator.size` and
    that no page is held twice (with sets), and that page 0 is never held.
    """
    P = getattr(allocator, "page_size", 1)
    free_pages = allocator.free_pages if P > 1 else allocator.free_slots
    if hasattr(tree_cache, "all_values_flatten"):
        tree_slots = tree_cache.all_values_flatten().to(free_pages.device)
    else:
        tree_slots = free_pages.new_empty(0)
    tree_tokens = tree_cache.evictable_size() + tree_cache.protected_size()
    _expect(tree_slots.numel() == tree_tokens, f"tree holds {tree_slots.numel()} slots but reports {tree_tokens} tokens")
    owners = {"free list": free_pages.to(torch.int64), "tree": torch.unique(tree_slots // P)}
    _expect(owners["tree"].numel() * P == tree_tokens, "tree slots do not fill whole pages")
    private_tokens = 0
    for i, req in enumerate(live_reqs):
        row = req_to_token_pool.req_to_token[req.req_pool_idx]
        span = row[req.cache_protected_len : req.kv_allocated_len].to(torch.int64)
        pages = torch.unique(span // P)
        expected = -(-span.numel() // P)
        _expect(pages.numel() == expected, f"live request #{i} private range covers {pages.numel()} pages, expected {expected}")
        owners[f"request #{i} (row {req.req_pool_idx})"] = pages
        private_tokens += expected * P
    total = allocator.available_size() + tree_tokens + private_tokens
    _expect(
        total == allocator.size,
        f"slots leaked or double-counted: free {allocator.available_size()} + tree {tree_tokens} + "
        f"private {private_tokens} = {total} != pool size {allocator.size}",
    )
    everything = torch.cat(list(owners.values()))
    if everything.numel():
        _expect(int(everything.min()) > 0, "page/slot 0 (the dummy) is owned")
    if torch.unique(everything).numel() != everything.numel():
        _report_double_owner(owners)


def _report_double_owner(owners: dict) -> None:
    seen: dict = {}
    for name, pages in owners.items():
        for page in pages.tolist():
            _expect(page not in seen or seen[page] == name, f"page/slot {page} is owned by both {seen.get(page)} and {name}")
            seen[page] = name
    _expect(False, "a page is owned twice within one owner")
