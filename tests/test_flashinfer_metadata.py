"""The FlashInfer page table (`flashinfer_metadata`) describes exactly the KV the torch backend reads.

Layouts come from the real allocators and `ReqToTokenPool`, filled in interleaved chunks so a
request's pages are scattered and prefixes end mid-page. `paged_attention_reference` reads the
pool the way FlashInfer does (NHD pages + CSR metadata, bottom-right causal mask), so agreeing
with `TorchNativeAttnBackend` checks the metadata's meaning end to end on CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace
from typing import List

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.flashinfer_metadata import (
    FlashInferMetadata,
    build_decode_metadata,
    build_extend_metadata,
    build_forward_metadata,
)
from kernels.attention.torch_native_backend import TorchNativeAttnBackend
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch

PAGE_SIZES = (1, 4, 16)


@dataclass
class FakeLayer:
    """The attributes of RadixAttention that attention backends read."""

    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    scaling: float


@dataclass
class Layout:
    """Pools and allocator of one scenario, after every request's prefix is in `req_to_token`."""

    req_pool: ReqToTokenPool
    kv_pool: MHATokenToKVPool
    allocator: object
    rows: List[int]
    prefix_lens: List[int]
    extend_lens: List[int]
    page_size: int

    @property
    def seq_lens(self) -> List[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def last_locs(self, lens: List[int]) -> List[int]:
        r2t = self.req_pool.req_to_token
        return [int(r2t[row, n - 1]) if n > 0 else -1 for row, n in zip(self.rows, lens)]


def make_allocator(size: int, page_size: int, device="cpu"):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, device)
    return PagedTokenToKVPoolAllocator(size, page_size, device)


def _extend_rows(layout: Layout, starts: List[int], ends: List[int]) -> torch.Tensor:
    """Allocate positions `starts[i] .. ends[i]` of every request at once and record them."""
    out = layout.allocator.alloc_extend(starts, ends, layout.last_locs(starts))
    assert out is not None, "test pool too small"
    offset = 0
    for row, s, e in zip(layout.rows, starts, ends):
        layout.req_pool.write(row, s, out[offset : offset + e - s])
        offset += e - s
    return out


def build_layout(
    page_size: int,
    prefix_lens: List[int],
    extend_lens: List[int],
    seed: int,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    store_dtype: torch.dtype | None = None,
) -> Layout:
    """Fill each prefix in random interleaved chunks (scattered pages), leave the extend to the caller."""
    rng = random.Random(seed)
    bs = len(prefix_lens)
    room = 2 * page_size + 2  # decode steps the tests may add after the extend
    need = sum(-(-(p + e + room) // page_size) for p, e in zip(prefix_lens, extend_lens))
    size = (need + 8) * page_size
    req_pool = ReqToTokenPool(bs + 3, max(prefix_lens) + max(extend_lens) + room, device)
    rows = req_pool.alloc(bs + 3)
    rng.shuffle(rows)  # requests sit in arbitrary table rows
    kv_pool = MHATokenToKVPool(size, page_size, dtype, store_dtype or dtype, num_kv_heads, head_dim,
                               1, device)
    layout = Layout(req_pool, kv_pool, make_allocator(size, page_size, device), rows[:bs],
                    list(prefix_lens), list(extend_lens), page_size)
    filled = [0] * bs
    while filled != list(prefix_lens):
        ends = [min(p, f + rng.randint(0, 2 * page_size + 1)) for p, f in zip(prefix_lens, filled)]
        _extend_rows(layout, filled, ends)
        filled = ends
    return layout


def expand_pages(meta: FlashInferMetadata, i: int) -> torch.Tensor:
    """Token slots of request i, rebuilt from its pages and last page length."""
    P = meta.page_size
    lo, hi = int(meta.kv_indptr[i]), int(meta.kv_indptr[i + 1])
    pages = meta.kv_indices[lo:hi].to(torch.int64)
    slots = (pages[:, None] * P + torch.arange(P, device=pages.device)).reshape(-1)
    return slots[: (hi - lo - 1) * P + int(meta.kv_last_page_len[i])]


def paged_attention_reference(
    q: torch.Tensor, meta: FlashInferMetadata, kv_pool: MHATokenToKVPool, layer: FakeLayer
) -> torch.Tensor:
    """FlashInfer's reading of the pool through `meta`, for q `[n, H*D]`; returns `[n, H*D]`."""
    P, KH, D = meta.page_size, layer.tp_k_head_num, layer.head_dim
    k_pages = kv_pool.get_key_buffer(layer.layer_id).view(-1, P, KH, D)
    v_pages = kv_pool.get_value_buffer(layer.layer_id).view(-1, P, KH, D)
    out = paged_attention(q.view(-1, layer.tp_q_head_num, D), meta.qo_indptr, meta.kv_indptr,
                          meta.kv_indices, meta.kv_last_page_len, k_pages, v_pages, layer.scaling)
    return out.view(q.shape)


def paged_attention(q, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, k_pages, v_pages, sm_scale):
    """FlashInfer's semantics in torch: q rows `[n, H, D]` split by `qo_indptr`, K/V from NHD
    pages `[num_pages, P, KH, D]` listed in CSR form, causal mask aligned bottom-right."""
    P, KH = k_pages.shape[1], k_pages.shape[2]
    out = torch.empty_like(q)
    for i in range(len(kv_last_page_len)):
        q_lo, q_hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
        lo, hi = int(kv_indptr[i]), int(kv_indptr[i + 1])
        kv_len = (hi - lo - 1) * P + int(kv_last_page_len[i])
        pages = kv_indices[lo:hi].to(torch.int64)
        k = k_pages[pages].reshape(-1, KH, q.shape[-1])[:kv_len].to(q.dtype)
        v = v_pages[pages].reshape(-1, KH, q.shape[-1])[:kv_len].to(q.dtype)
        q_pos = torch.arange(kv_len - (q_hi - q_lo), kv_len)[:, None]
        mask = (torch.arange(kv_len)[None, :] <= q_pos).to(q.device)
        o = F.scaled_dot_product_attention(
            q[q_lo:q_hi].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            attn_mask=mask, scale=sm_scale, enable_gqa=q.shape[1] != KH,
        )
        out[q_lo:q_hi] = o.transpose(0, 1)
    return out


def random_scenario(page_size: int, seed: int, bs: int = 5):
    """Prefix and extend lengths that cover empty, page-aligned and mid-page prefixes."""
    rng = random.Random(seed)
    P = page_size
    prefix = [0, P * rng.randint(1, 3), P * rng.randint(1, 3) + rng.randint(1, max(P - 1, 1))]
    prefix += [rng.randint(0, 4 * P + 3) for _ in range(bs - 3)]
    extend = [rng.randint(1, 3 * P + 2) for _ in range(bs)]
    return prefix, extend


def runner_for(layout: Layout, backend) -> SimpleNamespace:
    """The attributes `ForwardBatch.create_*` read from a model runner."""
    return SimpleNamespace(device=layout.req_pool.device, req_to_token_pool=layout.req_pool,
                           token_to_kv_pool=layout.kv_pool, attn_backend=backend)


def extend_batch(layout: Layout, backend) -> ForwardBatch:
    """Allocate and record the extend tokens, and the ForwardBatch that computes them."""
    out = _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    ids = [[0] * e for e in layout.extend_lens]
    return ForwardBatch.create_extend(runner_for(layout, backend), ids, layout.prefix_lens,
                                      layout.rows, out)


def decode_batch(layout: Layout, backend, seq_lens: List[int]) -> ForwardBatch:
    """Allocate and record one more token per request (position `seq_lens[i] - 1`)."""
    device = layout.req_pool.device
    new_lens = torch.tensor([s + 1 for s in seq_lens], device=device)
    last = torch.tensor(layout.last_locs(seq_lens), device=device)
    out = layout.allocator.alloc_decode(new_lens, last)
    assert out is not None, "test pool too small"
    for row, s, slot in zip(layout.rows, seq_lens, out):
        layout.req_pool.write(row, s, slot.view(1))
    rows = torch.tensor(layout.rows, device=device)
    return ForwardBatch.create_decode(runner_for(layout, backend), torch.zeros(len(seq_lens)),
                                      new_lens.tolist(), rows, out)


def fill_prefix_kv(layout: Layout, gen: torch.Generator) -> None:
    """Random K/V at every prefix slot of every request (layer 0)."""
    r2t = layout.req_pool.req_to_token
    slots = torch.cat([r2t[row, :p] for row, p in zip(layout.rows, layout.prefix_lens)]).to(torch.int64)
    shape = (len(slots), layout.kv_pool.head_num, layout.kv_pool.head_dim)
    dev = layout.req_pool.device
    k = torch.randn(shape, generator=gen).to(dev, layout.kv_pool.dtype)
    v = torch.randn(shape, generator=gen).to(dev, layout.kv_pool.dtype)
    layout.kv_pool.set_kv_buffer(0, slots, k, v)


def random_qkv(n: int, layer: FakeLayer, gen: torch.Generator, dtype, device):
    H, KH, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    q = torch.randn(n, H * D, generator=gen).to(device, dtype)
    k = torch.randn(n, KH, D, generator=gen).to(device, dtype)
    v = torch.randn(n, KH, D, generator=gen).to(device, dtype)
    return q, k, v


def check_pages_reproduce_req_to_token(meta: FlashInferMetadata, layout: Layout, seq_lens) -> None:
    r2t = layout.req_pool.req_to_token
    assert meta.batch_size == len(seq_lens)
    for i, (row, n) in enumerate(zip(layout.rows, seq_lens)):
        assert torch.equal(expand_pages(meta, i), r2t[row, :n].to(torch.int64)), f"request {i}"


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_extend_pages_expand_to_req_to_token(page_size, seed):
    prefix, extend = random_scenario(page_size, seed)
    layout = build_layout(page_size, prefix, extend, seed)
    _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    rows = torch.tensor(layout.rows)
    meta = build_extend_metadata(layout.req_pool.req_to_token, rows, layout.seq_lens, extend, page_size)
    check_pages_reproduce_req_to_token(meta, layout, layout.seq_lens)
    assert torch.diff(meta.qo_indptr).tolist() == extend
    assert torch.diff(meta.kv_indptr).tolist() == [-(-s // page_size) for s in layout.seq_lens]


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_decode_pages_expand_to_req_to_token(page_size, seed):
    prefix, extend = random_scenario(page_size, seed)
    layout = build_layout(page_size, prefix, extend, seed)
    _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    seq_lens = layout.seq_lens
    for _ in range(page_size + 1):  # every request crosses a page boundary at least once
        fb = decode_batch(layout, None, seq_lens)
        meta = build_forward_metadata(fb, page_size)
        check_pages_reproduce_req_to_token(meta, layout, fb.seq_lens_cpu)
        assert meta.qo_indptr.tolist() == list(range(len(prefix) + 1))
        seq_lens = fb.seq_lens_cpu


def test_metadata_is_int32_with_last_page_len_in_range():
    layout = build_layout(4, [0, 3, 4, 5], [1, 1, 4, 3], seed=0)
    _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    meta = build_extend_metadata(layout.req_pool.req_to_token, torch.tensor(layout.rows),
                                 layout.seq_lens, layout.extend_lens, 4)
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len):
        assert t.dtype == torch.int32
    assert meta.kv_last_page_len.tolist() == [1, 4, 4, 4]
    assert meta.kv_indptr.tolist() == [0, 1, 2, 4, 6]
    assert meta.num_pages == 6


def test_page_zero_is_never_referenced():
    layout = build_layout(16, [5, 17, 0], [30, 1, 16], seed=1)
    _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    meta = build_extend_metadata(layout.req_pool.req_to_token, torch.tensor(layout.rows),
                                 layout.seq_lens, layout.extend_lens, 16)
    assert int(meta.kv_indices.min()) >= 1


def test_metadata_accepts_tensor_lengths():
    layout = build_layout(4, [2, 9], [3, 7], seed=2)
    _extend_rows(layout, layout.prefix_lens, layout.seq_lens)
    args = (layout.req_pool.req_to_token, torch.tensor(layout.rows))
    a = build_extend_metadata(*args, layout.seq_lens, layout.extend_lens, 4)
    b = build_extend_metadata(*args, torch.tensor(layout.seq_lens), torch.tensor(layout.extend_lens), 4)
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_paged_attention_from_metadata_matches_torch_native(page_size, q_heads, kv_heads):
    """Extend then decode: FlashInfer's reading of the metadata equals the torch backend."""
    seed = page_size * 10 + q_heads + kv_heads
    gen = torch.Generator().manual_seed(seed)
    prefix, extend = random_scenario(page_size, seed)
    layout = build_layout(page_size, prefix, extend, seed, num_kv_heads=kv_heads, head_dim=8)
    layer = FakeLayer(0, q_heads, kv_heads, 8, scaling=0.3)
    fill_prefix_kv(layout, gen)
    backend = TorchNativeAttnBackend()

    fb = extend_batch(layout, backend)
    backend.init_forward_metadata(fb)
    q, k, v = random_qkv(sum(extend), layer, gen, torch.float32, "cpu")
    out = backend.forward(q, k, v, layer, fb)
    ref = paged_attention_reference(q, build_forward_metadata(fb, page_size), layout.kv_pool, layer)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    fb = decode_batch(layout, backend, layout.seq_lens)
    backend.init_forward_metadata(fb)
    q, k, v = random_qkv(len(prefix), layer, gen, torch.float32, "cpu")
    out = backend.forward(q, k, v, layer, fb)
    ref = paged_attention_reference(q, build_forward_metadata(fb, page_size), layout.kv_pool, layer)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
