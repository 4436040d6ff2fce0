"""Per-step FlashInfer page tables built from `req_to_token` (pure torch, no flashinfer import).

FlashInfer reads the KV pool as pages `[num_pages, page_size, kv_heads, head_dim]` (NHD) and each
request as a CSR list of page ids. Our pool already is that layout: token position j of a
request lives at slot `page * page_size + j % page_size` (the paged allocator fills a request's
last partial page before taking a new one), so the page id of positions `k*P .. k*P + P-1` is
`req_to_token[row, k*P] // P`, and only one column per page needs reading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Union

import torch

from kernels.device_utils import host_to_device

Lengths = Union[Sequence[int], torch.Tensor]


@dataclass
class FlashInferMetadata:
    """The CSR page table of one forward step (all int32, on the pool's device).

    - `qo_indptr [bs+1]`: request i's queries are rows `qo_indptr[i] : qo_indptr[i+1]` of q
      (decode: `0..bs`).
    - `kv_indptr [bs+1]`: request i's pages are `kv_indices[kv_indptr[i] : kv_indptr[i+1]]`,
      `ceil(seq_len / page_size)` of them, in position order.
    - `kv_last_page_len [bs]`: valid tokens in each request's last page, in `1 .. page_size`.
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    page_size: int

    @property
    def batch_size(self) -> int:
        return self.kv_last_page_len.numel()

    @property
    def num_pages(self) -> int:
        return self.kv_indices.numel()


def _host_lengths(lengths: Lengths) -> List[int]:
    """Lengths on the host; pass host lists (`seq_lens_cpu`): a device tensor here is read back."""
    if isinstance(lengths, torch.Tensor):
        return [int(x) for x in lengths.detach().to("cpu", torch.int64).tolist()]
    return [int(x) for x in lengths]


def _indptr(counts: torch.Tensor) -> torch.Tensor:
    """`[0, c0, c0 + c1, ...]` on the device of `counts` (int64)."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    torch.cumsum(counts, 0, out=out[1:])
    return out


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Lengths,
    page_size: int,
    seq_lens_dev: Optional[torch.Tensor] = None,
):
    """Return `(kv_indptr, kv_indices, kv_last_page_len)` for requests of lengths `seq_lens`.

    Built on the device from `seq_lens_dev` (the step's device lengths; made from `seq_lens`
    when absent); the host lengths only give the total page count, so nothing is read back.
    One vectorized gather: every page of the batch is tagged with its request (`owner`) and its
    ordinal within that request, which names the column `ordinal * page_size` to read.
    """
    host = _host_lengths(seq_lens)
    assert len(host) == req_pool_indices.numel(), "one seq_len per request"
    assert all(s >= 1 for s in host), f"every request needs at least one KV token, got {host}"
    device = req_to_token.device
    seq = host_to_device(host, torch.int64, device) if seq_lens_dev is None else seq_lens_dev.to(device, torch.int64)
    total = sum(-(-s // page_size) for s in host)
    num_pages = torch.div(seq + page_size - 1, page_size, rounding_mode="floor")
    kv_indptr = _indptr(num_pages)

    bs = len(host)
    owner = torch.repeat_interleave(torch.arange(bs, device=device), num_pages, output_size=total)
    ordinal = torch.arange(total, device=device) - kv_indptr[:-1][owner]
    rows = req_pool_indices.to(device=device, dtype=torch.int64)[owner]
    kv_indices = torch.div(req_to_token[rows, ordinal * page_size], page_size, rounding_mode="floor")

    kv_last_page_len = (seq - 1) % page_size + 1
    return kv_indptr.to(torch.int32), kv_indices.to(torch.int32), kv_last_page_len.to(torch.int32)


def build_extend_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Lengths,
    extend_lens: Lengths,
    page_size: int,
    seq_lens_dev: Optional[torch.Tensor] = None,
) -> FlashInferMetadata:
    """Extend step: `extend_lens[i]` new tokens at the end of `seq_lens[i]` (prefix included)."""
    ext = _host_lengths(extend_lens)
    seq = _host_lengths(seq_lens)
    assert all(0 <= e <= s for e, s in zip(ext, seq)), f"extend lens {ext} must lie in 0..seq_len {seq}"
    kv_indptr, kv_indices, kv_last_page_len = build_page_table(
        req_to_token, req_pool_indices, seq, page_size, seq_lens_dev
    )
    device = req_to_token.device
    qo_indptr = _indptr(host_to_device(ext, torch.int64, device)).to(torch.int32)
    return FlashInferMetadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)


def build_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: Lengths,
    page_size: int,
    seq_lens_dev: Optional[torch.Tensor] = None,
) -> FlashInferMetadata:
    """Decode step: one query per request at position `seq_lens[i] - 1` (seq_lens include it)."""
    kv_indptr, kv_indices, kv_last_page_len = build_page_table(
        req_to_token, req_pool_indices, seq_lens, page_size, seq_lens_dev
    )
    bs = kv_last_page_len.numel()
    qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=req_to_token.device)
    return FlashInferMetadata(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, page_size)


def build_forward_metadata(fb, page_size: int) -> FlashInferMetadata:
    """Metadata of a `ForwardBatch`: device tensors from its device lengths, sizes from its host
    lengths (no device-to-host copy)."""
    req_to_token = fb.req_to_token_pool.req_to_token
    if fb.forward_mode.is_decode():
        return build_decode_metadata(req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, page_size, fb.seq_lens)
    return build_extend_metadata(
        req_to_token, fb.req_pool_indices, fb.seq_lens_cpu, fb.extend_seq_lens_cpu, page_size, fb.seq_lens
    )
