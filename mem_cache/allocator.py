"""KV slot allocators: a free list of token slots (page_size 1) or of whole pages.

Slot 0 (page 0) is never handed out. `alloc*` return None on a shortage (callers evict or
retract and try again); they never raise for a normal shortage.

The free list is lazy: never-used ids are a counter (`_next`), released ids are kept as a list
of tensors merged only when an allocation reaches into them. So start-up costs O(1) even for
a pool of millions of slots, and `free` costs O(freed), not O(pool).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from kernels.device_utils import host_to_device

Lengths = Union[Sequence[int], torch.Tensor]


def _host_list(lengths: Lengths) -> List[int]:
    """Host lengths; the scheduler passes lists (a tensor here is a test's convenience)."""
    return lengths.tolist() if isinstance(lengths, torch.Tensor) else [int(x) for x in lengths]


class _LazyFreeList:
    """Free ids `1 .. capacity`: released tensors first, then the never-used tail."""

    def __init__(self, capacity: int, device):
        self.capacity = capacity
        self.device = device
        self.clear()

    def clear(self) -> None:
        self._next = 1
        self._released: List[torch.Tensor] = []
        self._released_count = 0

    def __len__(self) -> int:
        return self._released_count + (self.capacity - self._next + 1)

    def take(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self):
            return None
        parts = []
        if self._released_count and n:
            pool = self._released[0] if len(self._released) == 1 else torch.cat(self._released)
            k = min(n, len(pool))
            parts.append(pool[:k])
            rest = pool[k:]
            self._released = [rest] if len(rest) else []
            self._released_count = len(rest)
            n -= k
        if n:
            parts.append(torch.arange(self._next, self._next + n, dtype=torch.int64, device=self.device))
            self._next += n
        if not parts:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def put(self, ids: torch.Tensor) -> None:
        if ids.numel():
            self._released.append(ids.to(torch.int64))
            self._released_count += ids.numel()

    def materialize(self) -> torch.Tensor:
        """The whole free list as one tensor (tests and debugging)."""
        tail = torch.arange(self._next, self.capacity + 1, dtype=torch.int64, device=self.device)
        return torch.cat(self._released + [tail])

    def assign(self, ids: torch.Tensor) -> None:
        """Replace the free list by `ids` in that order (tests shuffle it)."""
        self._released, self._released_count = [ids.to(torch.int64)], ids.numel()
        self._next = self.capacity + 1


class TokenToKVPoolAllocator:
    """Free list of single KV slots `1 .. size`."""

    page_size = 1

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size = size
        self.device = device
        self._free = _LazyFreeList(size, device)

    @property
    def free_slots(self) -> torch.Tensor:
        return self._free.materialize()

    @free_slots.setter
    def free_slots(self, value: torch.Tensor) -> None:
        self._free.assign(value)

    def clear(self) -> None:
        self._free.clear()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        return self._free.take(need_size)

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """Slots for positions `prefix_len .. seq_len` of each request, concatenated."""
        return self.alloc(int(sum(seq_lens) - sum(prefix_lens)))

    def alloc_decode(self, seq_lens: Lengths, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position `seq_len - 1` (seq_lens already include it)."""
        return self.alloc(len(seq_lens))

    def free(self, free_index: torch.Tensor) -> None:
        self._free.put(free_index)

    def free_aligned(self, free_index: torch.Tensor) -> None:
        """Same as `free` here (see the paged allocator)."""
        self._free.put(free_index)


class PagedTokenToKVPoolAllocator:
    """Free list of pages `1 .. size // page_size`; page p holds slots `[p*P, (p+1)*P)`.

    A request fills its last partial page before it takes a new one, so every page belongs
    to exactly one owner and `free` releases whole pages (the page of each given slot).
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device = "cpu"):
        if size % page_size:
            raise ValueError(f"KV pool size {size} is not a multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = device
        self._free = _LazyFreeList(self.num_pages, device)

    @property
    def free_pages(self) -> torch.Tensor:
        return self._free.materialize()

    @free_pages.setter
    def free_pages(self, value: torch.Tensor) -> None:
        self._free.assign(value)

    def clear(self) -> None:
        self._free.clear()

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Whole pages only: `need_size` must be a multiple of the page size."""
        if need_size % self.page_size:
            raise ValueError(f"paged alloc needs a multiple of {self.page_size}, got {need_size}")
        pages = self._free.take(need_size // self.page_size)
        return None if pages is None else self._pages_to_slots(pages)

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Union[torch.Tensor, Sequence[int]]
    ) -> Optional[torch.Tensor]:
        """Continue each request's partial last page (`last_loc` = slot of position
        `prefix_len - 1`, ignored when the prefix is page-aligned), then take new pages.

        `last_loc` may live on the device: the partial-page slots are computed from it with
        tensor ops, so its values are never read on the host."""
        P = self.page_size
        new_pages = [-(-s // P) - (-(-p // P)) for p, s in zip(prefix_lens, seq_lens)]
        pages = self._free.take(sum(new_pages))
        if pages is None:
            return None
        out, used = [], 0
        for p, s, last, n in zip(prefix_lens, seq_lens, last_loc, new_pages):
            head = min(s, -(-p // P) * P) - p  # tokens that fit in the partial page
            if head > 0:
                out.append(last + torch.arange(1, 1 + head, dtype=torch.int64, device=self.device))
            if n:
                slots = self._pages_to_slots(pages[used : used + n])
                used += n
                out.append(slots[: s - p - max(head, 0)])
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(out).to(torch.int64)

    def alloc_decode(self, seq_lens: Lengths, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position `seq_len - 1`; only requests whose new token
        starts a page take a page. `seq_lens` are host lengths, so which rows need a page is
        known without reading the device."""
        rows = [i for i, s in enumerate(_host_list(seq_lens)) if (s - 1) % self.page_size == 0]
        pages = self._free.take(len(rows))
        if pages is None:
            return None
        out = last_loc.to(torch.int64) + 1
        if rows:
            out.index_copy_(0, host_to_device(rows, torch.int64, out.device), pages * self.page_size)
        return out

    def free(self, free_index: torch.Tensor) -> None:
        """Free the page of every given slot (any order, repeats allowed; `torch.unique` reads
        the device, so the scheduler's hot path uses `free_aligned`)."""
        if free_index.numel():
            self._free.put(torch.unique(free_index.to(torch.int64) // self.page_size))

    def free_aligned(self, free_index: torch.Tensor) -> None:
        """Free whole pages given as their slots in position order, starting on a page boundary
        (a tree value, or a request's span from a page-aligned position). One slot per page
        names it, so no de-duplication (and no host read) is needed."""
        if free_index.numel():
            self._free.put(free_index[:: self.page_size].to(torch.int64) // self.page_size)
