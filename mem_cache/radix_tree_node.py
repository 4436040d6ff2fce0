"""Keys and nodes of the radix prefix cache.

A `RadixKey` is a token-id sequence plus an optional namespace (`extra_key`). Token ids are
packed into int32 bytes (lazily, only as far as a comparison gets) so the tree compares spans
with `bytes ==` (a C memcmp) and never walks tokens one by one in Python. Slicing a key is O(1)
(a window on the same token list), so inserting a leaf or splitting a node packs nothing.
"""

from __future__ import annotations

import itertools
import struct
from array import array
from typing import Dict, Hashable, Iterator, List, Optional, Sequence, Union

import torch

_INT32 = 4  # bytes per packed token id
FIRST_WINDOW = 512  # tokens compared (and packed) first when a key is not packed that far yet
WINDOW_STEP = 4096  # most tokens a comparison window or a packing step grows by at once
_UNPACK_ONE = struct.Struct("i").unpack_from
_new_key = object.__new__


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as native int32 bytes (one C pass; ids must fit in int32)."""
    try:
        return struct.pack(f"{len(token_ids)}i", *token_ids)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in the int32 range: {e}") from None


_PAGE_UNPACKERS = {}  # page size -> compiled `struct.Struct(f"{size}i").unpack_from`


def _page_unpacker(size: int):
    unpacker = _PAGE_UNPACKERS.get(size)
    if unpacker is None:
        unpacker = _PAGE_UNPACKERS[size] = struct.Struct(f"{size}i").unpack_from
    return unpacker


class RadixKey:
    """Token ids plus an optional hashable namespace `extra_key` (cache salt, LoRA id).

    Keys with different `extra_key` never share tree nodes. Slicing keeps `extra_key`.
    A key keeps a reference to the given list (no copy). A key built on a list follows it as
    it grows (appending is how a request's key gains its outputs), unless built `fixed` (the
    ids the list holds now: how the cache wraps a plain list it is given); a slice is a fixed
    window `[start, stop)` of that list, made in O(1), so `RadixCache.insert` stores the new
    leaf's tokens and `_split` cuts a node without copying or packing anything. Do not change a
    list in place while a key or a tree node refers to it (appending is fine).

    Child lookups read a page's ids as they are (`page_key`: an int, or a tuple of ints), so a
    walk that misses packs nothing.

    Packing ids into int32 bytes is the one per-token cost of a comparison (~10 ns/token in
    CPython). It is done lazily, only as far as a comparison has got (`packed_upto`), and
    cached: matching the same key object again costs no packing, and a node key is packed at
    most once. A window that is packed to its end drops its list reference (the tree then
    keeps 4 bytes per token, not the list). A key built with `from_packed` (ids shipped as
    int32 bytes, e.g. `array("i", ids).tobytes()` in the tokenizer process) never packs.

    Internal state: `_ids` (the list, or None once all ids are in `_packed`), the window
    `_start` / `_stop` on it (`_stop` None: up to the list's current end), and `_packed`, the
    bytes of a *prefix* of the key's ids.
    """

    __slots__ = ("_ids", "_start", "_stop", "_packed", "extra_key")

    def __init__(self, token_ids: Sequence[int] = (), extra_key: Optional[Hashable] = None,
                 fixed: Union[bool, int] = False):
        ids = token_ids if type(token_ids) is list else list(token_ids)
        self._ids: Optional[List[int]] = ids
        self._start = 0
        # fixed: the ids the list holds now (an int: its first `fixed` ids); else follow the list
        self._stop: Optional[int] = None if fixed is False else len(ids) if fixed is True else fixed
        self._packed = b""
        self.extra_key = extra_key

    @classmethod
    def from_packed(cls, packed: bytes, extra_key: Optional[Hashable] = None) -> RadixKey:
        """A key over already-packed int32 bytes (token list materialized only on demand)."""
        if len(packed) % _INT32:
            raise ValueError(f"packed token ids must be int32 bytes, got {len(packed)} bytes")
        key = cls.__new__(cls)
        key._ids, key._start, key._stop = None, 0, None
        key._packed = bytes(packed)
        key.extra_key = extra_key
        return key

    @property
    def token_ids(self) -> List[int]:
        """The ids as a list: the key's own list when it is not a window, else a new list."""
        ids = self._ids
        if ids is None:
            return array("i", self._packed).tolist()
        if self._start == 0 and self._stop is None:
            return ids
        return ids[self._start : self._stop]

    @property
    def packed(self) -> bytes:
        """All ids as int32 bytes."""
        return self.packed_upto(len(self))

    def packed_upto(self, n: int) -> bytes:
        """int32 bytes covering at least the first `n` ids (all of them if the key is shorter).

        Packs ahead geometrically (at least 64 ids, doubling, by at most WINDOW_STEP ids at a
        time), so a walk through many short nodes extends the buffer O(log) times, while a match
        that stops early in a long key packs at most ~2x (and WINDOW_STEP ids) beyond what it
        compared."""
        packed = self._packed
        have = len(packed) >> 2
        ids = self._ids
        if have >= n or ids is None:
            return packed
        length = self.__len__()
        upto = min(length, max(n, 64, have + min(have, WINDOW_STEP)))
        start = self._start
        packed = self._packed = packed + pack_token_ids(ids[start + have : start + upto])
        if upto == length and self._stop is not None:
            self._ids = None  # a window packed to its end needs its list no more
        return packed

    def page_key(self, pos: int, size: int) -> Hashable:
        """The ids `[pos, pos + size)` (within the key) as a hashable, packing nothing: the id
        itself for size 1, else a tuple of ids (as SGLang keys a node's children). Read from the
        token list, or unpacked when the key holds bytes only."""
        ids = self._ids
        if ids is not None:
            start = self._start + pos
            return ids[start] if size == 1 else tuple(ids[start : start + size])
        if size == 1:
            return _UNPACK_ONE(self._packed, pos * _INT32)[0]
        return _page_unpacker(size)(self._packed, pos * _INT32)

    @property
    def num_packed(self) -> int:
        """How many leading ids are packed already."""
        return len(self._packed) >> 2

    @property
    def fixed(self) -> bool:
        """The key's length cannot change (a window or packed bytes, not a growing list)."""
        return self._ids is None or self._stop is not None

    def __len__(self) -> int:
        ids = self._ids
        if ids is None:
            return len(self._packed) >> 2
        return (len(ids) if self._stop is None else self._stop) - self._start

    def __getitem__(self, idx: Union[int, slice]) -> Union[int, RadixKey]:
        if not isinstance(idx, slice):
            i = range(len(self))[idx]  # normalizes negative indices, raises IndexError
            if i < self.num_packed:
                return struct.unpack_from("i", self._packed, i * _INT32)[0]
            return self._ids[self._start + i]
        start, stop, step = idx.indices(len(self))
        if step != 1:
            raise ValueError("RadixKey slices must be contiguous (step 1)")
        return self.window(start, max(start, stop))

    def window(self, start: int, stop: int) -> RadixKey:
        """`self[start:stop]` for `0 <= start <= stop <= len(self)`, without slice parsing. A
        fixed key asked for all of itself is returned as it is (a key's content never changes;
        packing only caches it)."""
        if start == 0 and self._stop is not None and stop == self._stop - self._start:
            return self
        out = _new_key(RadixKey)
        out.extra_key = self.extra_key
        packed = self._packed
        if self._ids is None or len(packed) >= stop * _INT32:  # packed that far: bytes only
            out._packed, out._ids, out._start, out._stop = packed[start * _INT32 : stop * _INT32], None, 0, None
            return out
        # A slice of a packed prefix is a packed prefix of the slice (empty if it starts beyond).
        out._packed = packed[start * _INT32 :] if len(packed) > start * _INT32 else b""
        out._ids, out._start, out._stop = self._ids, self._start + start, self._start + stop
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


def common_prefix_len(node_key: RadixKey, key: RadixKey, pos: int, span: int) -> int:
    """How many tokens `node_key[:span]` and `key[pos:pos+span]` share (span >= 1).

    Spans are compared with `bytes ==`, never token by token. When both keys are packed that
    far the whole span is compared at once; so is a span of up to 2 x FIRST_WINDOW tokens
    (packed exactly that far: a second window would pack ahead of it). Longer spans are compared
    in windows that grow from FIRST_WINDOW tokens (doubling, by at most WINDOW_STEP), packing
    each key only as far as compared, so a mismatch early in a long node costs little and a
    node is never packed much beyond its divergence.
    Inside the first window that differs, bisection on slices keeps `a[:lo] == b[:lo]` and
    `a[:hi] != b[:hi]`.
    """
    W = _INT32
    a, b = node_key._packed, key._packed
    lo, hi = 0, span
    if len(a) < span * W or len(b) < (pos + span) * W:
        hi = span if span <= 2 * FIRST_WINDOW else FIRST_WINDOW
    while True:
        if len(a) < hi * W:
            a = node_key.packed_upto(hi)
        if len(b) < (pos + hi) * W:
            b = key.packed_upto(pos + hi)
        if a[lo * W : hi * W] != b[(pos + lo) * W : (pos + hi) * W]:
            break
        if hi == span:
            return span
        lo, hi = hi, min(span, hi + min(hi, WINDOW_STEP))
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[lo * W : mid * W] == b[(pos + lo) * W : (pos + mid) * W]:
            lo = mid
        else:
            hi = mid
    return lo


_PIN_SLACK = 8192  # slots (64 KiB) a node value may keep alive beyond its own before it is copied
_INT64 = torch.int64


def node_slots(value: torch.Tensor, start: int, stop: int, whole: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """A new node's slot tensor for `value[start:stop]` (`whole = len(value)`): a view of
    `value`, the caller's tensor (no copy, as SGLang does), except for a copy when `value` is not
    int64, when it is a view of `rows` (`req_to_token`, rewritten when a row is reused) or when
    the view would keep alive over twice its own size and over `_PIN_SLACK` slots more."""
    if value.dtype is not _INT64:
        return value[start:stop].to(_INT64)  # a dtype conversion is a copy
    kept, base = stop - start, value._base  # base: the tensor whose memory a view shares
    if base is None:  # value owns its memory; 1-D, so it is not req_to_token
        pinned = whole - kept  # slots the view keeps alive beyond its own
        if pinned == 0:
            return value
        part = value[start:stop]
        return part.clone() if pinned > kept and pinned > _PIN_SLACK else part
    pinned = base.numel() - kept
    part = value if start == 0 and stop == whole else value[start:stop]
    return part.clone() if base is rows or (pinned > kept and pinned > _PIN_SLACK) else part


_node_ids = itertools.count()


class TreeNode:
    """One radix-tree node: `key[i]` is a token whose KV lives in slot `value[i]`.

    `value` is an int64 slot tensor of the same length as `key`, often a view of the tensor
    handed to `insert` (never of a `req_to_token` row, which is rewritten when the row is
    reused); the tree never writes to it. The slots are owned by the tree and valid only while
    the node is in the tree (readers lock it with `inc_lock_ref`). `key` is a fixed window.
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

    def __init__(
        self,
        key: Optional[RadixKey] = None,
        value: Optional[torch.Tensor] = None,
        parent: Optional[TreeNode] = None,
        last_access_time: int = 0,
    ):
        self.children: Dict[Hashable, TreeNode] = {}
        self.parent = parent
        self.key = key if key is not None else RadixKey.from_packed(b"")
        self.value = value if value is not None else torch.empty(0, dtype=torch.int64, device="cpu")
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.hit_count = 0
        self.id = next(_node_ids)
        self.in_heap = False
        self.evicted = False

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, children={len(self.children)})"
