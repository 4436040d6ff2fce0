"""Keys and nodes of the radix prefix cache.

A `RadixKey` is a token-id sequence plus an optional namespace (`extra_key`). Token ids are
packed into int32 bytes (lazily, only as far as a match gets) so the tree compares spans with
`bytes ==` (a C memcmp) and never walks tokens one by one in Python.
"""

from __future__ import annotations

import itertools
import struct
from array import array
from typing import Dict, Hashable, Iterator, List, Optional, Sequence, Union

import torch

_INT32 = 4  # bytes per packed token id
FIRST_WINDOW = 1024  # tokens compared (and packed) first when a key is not packed that far yet


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as native int32 bytes (one C pass; ids must fit in int32)."""
    try:
        return struct.pack(f"{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in the int32 range: {e}") from None


class RadixKey:
    """Token ids plus an optional hashable namespace `extra_key` (cache salt, LoRA id).

    Keys with different `extra_key` never share tree nodes. Slicing keeps `extra_key`.
    The key keeps a reference to the given list (no copy): do not mutate it while the key is
    in use. Packing ids into int32 bytes is the one per-token cost of a match (~10 ns/token in
    CPython); it is done lazily, only up to where a match has got (`packed_upto`), and cached,
    so matching the same key object again (insert then match, a scheduler re-scoring a waiting
    request) costs no packing. A key built with `from_packed` (ids shipped as int32 bytes, e.g.
    `array("i", ids).tobytes()` in the tokenizer process) never packs at all.

    Internal state: `_ids` (list or None) and `_packed`, bytes covering a *prefix* of the ids
    (all of them when `_ids` is None).
    """

    __slots__ = ("_ids", "_packed", "extra_key")

    def __init__(self, token_ids: Sequence[int] = (), extra_key: Optional[Hashable] = None):
        self._ids: Optional[List[int]] = token_ids if isinstance(token_ids, list) else list(token_ids)
        self._packed = b""
        self.extra_key = extra_key

    @classmethod
    def from_packed(cls, packed: bytes, extra_key: Optional[Hashable] = None) -> RadixKey:
        """A key over already-packed int32 bytes (token list materialized only on demand)."""
        if len(packed) % _INT32:
            raise ValueError(f"packed token ids must be int32 bytes, got {len(packed)} bytes")
        key = cls.__new__(cls)
        key._ids = None
        key._packed = bytes(packed)
        key.extra_key = extra_key
        return key

    @property
    def token_ids(self) -> List[int]:
        if self._ids is None:
            self._ids = array("i", self._packed).tolist()
        return self._ids

    @property
    def packed(self) -> bytes:
        """All ids as int32 bytes."""
        return self.packed_upto(len(self))

    def packed_upto(self, n: int) -> bytes:
        """int32 bytes covering at least the first `n` ids.

        Packs ahead geometrically (at least 64 ids, doubling, by at most 8192 ids at a time),
        so a walk through many short nodes extends the buffer O(log) times, while a match that
        stops early in a long key packs at most ~2x (and 8192 ids) beyond what it compared."""
        packed = self._packed
        have = len(packed) // _INT32
        if have >= n or self._ids is None:
            return packed
        upto = min(len(self._ids), max(n, 64, have + min(have, 8192)))
        self._packed = packed + pack_token_ids(self._ids[have:upto])
        return self._packed

    @property
    def num_packed(self) -> int:
        """How many leading ids are packed already."""
        return len(self._packed) // _INT32

    def __len__(self) -> int:
        if self._ids is not None:
            return len(self._ids)
        return len(self._packed) // _INT32

    def __getitem__(self, idx: Union[int, slice]) -> Union[int, RadixKey]:
        if not isinstance(idx, slice):
            return self.token_ids[idx]
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("RadixKey slices must be contiguous (step 1)")
        out = RadixKey.__new__(RadixKey)
        out.extra_key = self.extra_key
        out._ids = self._ids[start:stop] if self._ids is not None else None
        # A slice of a packed prefix is a packed prefix of the slice (empty if it starts beyond).
        out._packed = self._packed[start * _INT32 : stop * _INT32]
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.extra_key == other.extra_key and self.packed == other.packed

    def __hash__(self) -> int:
        return hash((self.extra_key, self.packed))

    def __repr__(self) -> str:
        ids = self.token_ids
        shown = ids if len(ids) <= 12 else ids[:10] + ["..."]
        ns = "" if self.extra_key is None else f", extra_key={self.extra_key!r}"
        return f"RadixKey({shown}{ns}, len={len(ids)})"


def common_prefix_len(node_packed: bytes, key: RadixKey, pos: int, span: int) -> int:
    """How many tokens `node_packed[:span]` and `key[pos:pos+span]` share (span >= 1).

    Spans are compared with `bytes ==`, never token by token. A fully packed key compares the
    whole span at once; otherwise windows double from FIRST_WINDOW tokens, packing the key only
    as far as compared (a mismatch early in a long node costs little). Inside the first window
    that differs, bisection on slices keeps `a[:lo] == b[:lo]` and `a[:hi] != b[:hi]`.
    """
    W = _INT32
    lo, hi = 0, span if key.num_packed >= pos + span else min(span, FIRST_WINDOW)
    while True:
        packed = key.packed_upto(pos + hi)
        if node_packed[lo * W : hi * W] != packed[(pos + lo) * W : (pos + hi) * W]:
            break
        if hi == span:
            return span
        lo, hi = hi, min(span, 2 * hi)
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if node_packed[lo * W : mid * W] == packed[(pos + lo) * W : (pos + mid) * W]:
            lo = mid
        else:
            hi = mid
    return lo


_node_ids = itertools.count()


class TreeNode:
    """One radix-tree node: `key[i]` is a token whose KV lives in slot `value[i]`.

    `value` is an int64 slot tensor of the same length as `key`; the slots are owned by the
    tree and valid only while the node is in the tree (readers lock it with `inc_lock_ref`).
    `lock_ref` counts locks on this node *or any descendant* (a lock walks to the root).
    `in_heap` says the eviction heap holds exactly one (possibly stale) entry for this node.
    """

    __slots__ = (
        "children",
        "parent",
        "key",
        "value",
        "lock_ref",
        "last_access_time",
        "hit_count",
        "id",
        "in_heap",
        "evicted",
    )

    def __init__(self, key: Optional[RadixKey] = None, value: Optional[torch.Tensor] = None):
        self.children: Dict[Hashable, TreeNode] = {}
        self.parent: Optional[TreeNode] = None
        self.key = key if key is not None else RadixKey.from_packed(b"")
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64, device="cpu")
        self.lock_ref = 0
        self.last_access_time = 0
        self.hit_count = 0
        self.id = next(_node_ids)
        self.in_heap = False
        self.evicted = False

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"
