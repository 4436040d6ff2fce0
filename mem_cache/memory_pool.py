"""Memory pools: request slots (`ReqToTokenPool`) and per-layer K/V buffers (`MHATokenToKVPool`).

Ownership of KV *slots* is the allocator's business (`allocator.py`); these classes only hold
the storage and the `req_to_token` map from (request slot, position) to KV slot.
"""

from __future__ import annotations

import logging
import math
import mmap
from typing import List, Optional, Union

import torch

from kernels.cpu.elementwise import load_fused_ops

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class ReqToTokenPool:
    """Request slots and the `req_to_token` table `[size, max_context_len]` (int32).

    Row r, column p holds the KV slot of token p of the request that owns row r. A row is
    valid only while its request holds it (between `alloc` and `free`).
    """

    def __init__(self, size: int, max_context_len: int, device: Union[str, torch.device] = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.free_slots: List[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[List[int]]:
        """Take `need_size` request slots, or return None when fewer are free."""
        if need_size > len(self.free_slots):
            return None
        taken = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return taken

    def free(self, free_index: Union[int, List[int]]) -> None:
        if isinstance(free_index, int):
            self.free_slots.append(free_index)
        else:
            self.free_slots.extend(free_index)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record `slots` as the KV slots of positions `start .. start+len(slots)` of `row`."""
        self.req_to_token[row, start : start + len(slots)] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape `[size + page_size, head_num, head_dim]`.

    Slot 0 (the whole first page) is a dummy that is never handed out: padded tokens write
    there, and it is zero-filled so that masked reads of it stay finite. fp8 storage is
    upcast to `dtype` by the reader *after* gathering, so only touched slots are converted.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        store_dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: Union[str, torch.device] = "cpu",
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = store_dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        self.rows = size + page_size
        self.page_size = page_size
        self._create_buffers()

    def _create_buffers(self) -> None:
        # Host pages are only touched when a slot is first written.
        shape = (self.rows, self.head_num, self.head_dim)
        self.k_buffer = [self._buffer(shape) for _ in range(self.layer_num)]
        self.v_buffer = [self._buffer(shape) for _ in range(self.layer_num)]
        for buf in self.k_buffer + self.v_buffer:
            buf[: self.page_size].zero_()

    def _buffer(self, shape: tuple) -> torch.Tensor:
        """`torch.empty`, except on CPU: an anonymous mapping of its own (zero pages on first touch),
        unmapped when the buffer dies. From malloc, a buffer could be carved from free heap space
        (the CPU model process raises malloc's thresholds), and freeing it would return nothing."""
        if torch.device(self.device).type != "cpu":
            return torch.empty(shape, dtype=self.store_dtype, device=self.device)
        count = math.prod(shape)
        mapping = mmap.mmap(-1, count * self.store_dtype.itemsize)
        return torch.frombuffer(mapping, dtype=self.store_dtype, count=count).view(shape)  # keeps `mapping` alive

    def release_host_pages(self) -> bool:
        """On CPU, give the touched pages of an empty pool back to the OS (fresh buffers; the old
        mappings are unmapped). Only when no slot is in use (after a cache flush):
        otherwise a host's RSS keeps every page the radix cache ever filled. No-op elsewhere."""
        if torch.device(self.device).type != "cpu":
            return False
        self.k_buffer, self.v_buffer = [], []
        self._create_buffers()
        return True

    @staticmethod
    def cell_size_bytes(head_num: int, head_dim: int, layer_num: int, store_dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        return head_num * head_dim * layer_num * 2 * torch.empty((), dtype=store_dtype).element_size()

    @property
    def cell_size(self) -> int:
        return self.cell_size_bytes(self.head_num, self.head_dim, self.layer_num, self.store_dtype)

    def get_kv_size_bytes(self) -> int:
        return self.cell_size * (self.size + self.page_size)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Raw storage (maybe fp8): gather first, then `.to(self.dtype)`."""
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write this step's K/V (`[n, head_num, head_dim]`) at slots `loc`."""
        if self.store_dtype in FP8_DTYPES:
            # Saturate instead of overflowing to NaN: fp8 casts do not clamp.
            fmax = torch.finfo(self.store_dtype).max
            cache_k = cache_k.clamp(-fmax, fmax).to(self.store_dtype)
            cache_v = cache_v.clamp(-fmax, fmax).to(self.store_dtype)
        elif self.store_dtype != cache_k.dtype:
            cache_k = cache_k.to(self.store_dtype)
            cache_v = cache_v.to(self.store_dtype)
        # index_copy_ rather than `buf[loc] = x`: advanced-index assignment is ~500x slower on
        # CPU. fp8 has no CPU index_copy_ kernel, so copy its bytes through a uint8 view.
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if self.store_dtype in FP8_DTYPES:
            k_buf, v_buf = k_buf.view(torch.uint8), v_buf.view(torch.uint8)
            cache_k, cache_v = cache_k.view(torch.uint8), cache_v.view(torch.uint8)
        if k_buf.device.type == "cpu" and not torch.compiler.is_compiling() and load_fused_ops():
            # Row copies in one C++ call: 2.5-2.7x faster than the two index_copy_ (16 and 1,200
            # rows). A compiled forward keeps index_copy_ (dynamo cannot trace the build check).
            torch.ops.srt_cpu.store_kv(k_buf, v_buf, loc, cache_k, cache_v)
            return
        k_buf.index_copy_(0, loc, cache_k)
        v_buf.index_copy_(0, loc, cache_v)
