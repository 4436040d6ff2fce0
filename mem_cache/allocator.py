"""KV slot allocators: a free list of token slots (page_size 1) or of whole pages.

Slot 0 (page 0) is never handed out. `alloc*` return None on a shortage (callers evict or
retract and try again); they never raise for a normal shortage.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


class TokenToKVPoolAllocator:
    """Free list of single KV slots `1 .. size`."""

    page_size = 1

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        self.size = size
        self.device = device
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        if need_size > len(self.free_slots):
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """Slots for positions `prefix_len .. seq_len` of each request, concatenated."""
        return self.alloc(int(sum(seq_lens) - sum(prefix_lens)))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position `seq_len - 1` (seq_lens already include it)."""
        return self.alloc(len(seq_lens))

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.free_slots = torch.cat((self.free_slots, free_index.to(torch.int64)))


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
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def _take_pages(self, n: int) -> Optional[torch.Tensor]:
        if n > len(self.free_pages):
            return None
        pages = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return pages

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Whole pages only: `need_size` must be a multiple of the page size."""
        if need_size % self.page_size:
            raise ValueError(f"paged alloc needs a multiple of {self.page_size}, got {need_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
    ) -> Optional[torch.Tensor]:
        """Continue each request's partial last page (`last_loc` = slot of position
        `prefix_len - 1`, ignored when the prefix is page-aligned), then take new pages."""
        P = self.page_size
        new_pages = [-(-s // P) - (-(-p // P)) for p, s in zip(prefix_lens, seq_lens)]
        pages = self._take_pages(sum(new_pages))
        if pages is None:
            return None
        out, used = [], 0
        for p, s, last, n in zip(prefix_lens, seq_lens, last_loc, new_pages):
            head = min(s, -(-p // P) * P) - p  # tokens that fit in the partial page
            if head > 0:
                out.append(torch.arange(int(last) + 1, int(last) + 1 + head, device=self.device))
            if n:
                mine = pages[used : used + n]
                used += n
                slots = (mine[:, None] * P + torch.arange(P, device=self.device)).reshape(-1)
                out.append(slots[: s - p - max(head, 0)])
        if not out:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        return torch.cat(out).to(torch.int64)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position `seq_len - 1`; only requests whose new token
        starts a page take a page."""
        needs_page = (seq_lens - 1) % self.page_size == 0
        n = int(needs_page.sum())
        pages = self._take_pages(n)
        if pages is None:
            return None
        out = last_loc.to(torch.int64) + 1
        out[needs_page] = pages * self.page_size
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        pages = torch.unique(free_index.to(torch.int64) // self.page_size)
        self.free_pages = torch.cat((self.free_pages, pages))
