"""`torch_native` paged attention equals dense causal SDPA over each whole sequence."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.attention.torch_native_backend import SDPA_LEN_MULTIPLE, TorchNativeAttnBackend
from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class Layer:
    layer_id: int
    tp_q_head_num: int
    tp_k_head_num: int
    head_dim: int
    scaling: float


def _setup(page_size, kv_heads, head_dim=16, size=2048):
    alloc = (TokenToKVPoolAllocator(size) if page_size == 1 else PagedTokenToKVPoolAllocator(size, page_size))
    # Shuffle the free list so requests get scattered, non-contiguous slots.
    if page_size == 1:
        alloc.free_slots = alloc.free_slots[torch.randperm(len(alloc.free_slots))]
    else:
        alloc.free_pages = alloc.free_pages[torch.randperm(len(alloc.free_pages))]
    pool = MHATokenToKVPool(size, page_size, torch.float32, torch.float32, kv_heads, head_dim, 1)
    req_pool = ReqToTokenPool(8, 512)
    backend = TorchNativeAttnBackend()
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=pool, attn_backend=backend)
    return alloc, runner


def _dense(q, k, v, prefix, scale, heads, kv_heads):
    """Reference: the whole sequence in one causal SDPA, rows of the new tokens only."""
    n = k.shape[0]
    rep = heads // kv_heads
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    full_q = torch.zeros(n, heads, q.shape[-1])
    full_q[prefix:] = q
    out = F.scaled_dot_product_attention(full_q.transpose(0, 1), kk, vv, is_causal=True, scale=scale)
    return out.transpose(0, 1)[prefix:]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_extend_and_decode_match_dense_sdpa(page_size, gqa, seed):
    torch.manual_seed(seed)
    kv_heads, D = 2, 16
    heads = kv_heads * gqa
    alloc, runner = _setup(page_size, kv_heads, D)
    layer = Layer(0, heads, kv_heads, D, D**-0.5)
    bs = 4
    prefix = torch.randint(0, 40, (bs,)).tolist()
    ext = torch.randint(1, 30, (bs,)).tolist()
    rows = runner.req_to_token_pool.alloc(bs)
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    ks = [torch.randn(p + e, kv_heads, D) for p, e in zip(prefix, ext)]
    vs = [torch.randn(p + e, kv_heads, D) for p, e in zip(prefix, ext)]
    # Prefix KV already in the pool (written by an earlier step).
    for i in range(bs):
        if prefix[i]:
            slots = alloc.alloc_extend([0], [prefix[i]], [0])
            table[rows[i], : prefix[i]] = slots.to(torch.int32)
            pool.set_kv_buffer(0, slots, ks[i][: prefix[i]], vs[i][: prefix[i]])
    last = [int(table[r, p - 1]) if p else 0 for r, p in zip(rows, prefix)]
    seq = [p + e for p, e in zip(prefix, ext)]
    out_loc = alloc.alloc_extend(prefix, seq, last)
    off = 0
    for i in range(bs):
        table[rows[i], prefix[i] : seq[i]] = out_loc[off : off + ext[i]].to(torch.int32)
        off += ext[i]
    fb = ForwardBatch.create_extend(runner, [[0] * e for e in ext], prefix, rows, out_loc)
    qs = [torch.randn(e, heads, D) for e in ext]
    k_new = torch.cat([k[p:] for k, p in zip(ks, prefix)])
    v_new = torch.cat([v[p:] for v, p in zip(vs, prefix)])
    backend = runner.attn_backend
    backend.init_forward_metadata(fb)
    # On the CPU each request's SDPA runs padded to a multiple of SDPA_LEN_MULTIPLE, its padded
    # keys read from the dummy slot 0: poisoned here, a real query that saw one would be far off.
    assert [pad for *_, pad in backend.extend_rows] == [-e % SDPA_LEN_MULTIPLE for e in ext]
    pool.get_key_buffer(0)[0].fill_(100.0)
    pool.get_value_buffer(0)[0].fill_(100.0)
    out = backend.forward(torch.cat(qs).reshape(-1, heads * D), k_new, v_new, layer, fb)
    off = 0
    for i in range(bs):
        ref = _dense(qs[i], ks[i], vs[i], prefix[i], layer.scaling, heads, kv_heads)
        got = out[off : off + ext[i]].view(ext[i], heads, D)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        off += ext[i]

    # One decode step on top: a new token per request.
    seq_t = torch.tensor(seq)
    last_loc = table[torch.tensor(rows), seq_t - 1].to(torch.int64)
    dec_loc = alloc.alloc_decode(seq_t + 1, last_loc)
    table[torch.tensor(rows), seq_t] = dec_loc.to(torch.int32)
    fb = ForwardBatch.create_decode(runner, torch.zeros(bs), [s + 1 for s in seq], torch.tensor(rows), dec_loc)
    qd = torch.randn(bs, heads, D)
    kd, vd = torch.randn(bs, kv_heads, D), torch.randn(bs, kv_heads, D)
    backend.init_forward_metadata(fb)
    out = backend.forward(qd.reshape(bs, -1), kd, vd, layer, fb).view(bs, heads, D)
    for i in range(bs):
        k_all = torch.cat([ks[i], kd[i : i + 1]])
        v_all = torch.cat([vs[i], vd[i : i + 1]])
        ref = _dense(qd[i : i + 1], k_all, v_all, seq[i], layer.scaling, heads, kv_heads)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_decode_ignores_stale_slots_beyond_each_sequence():
    """Padded decode must not read unwritten (possibly NaN) slots past a request's length."""
    alloc, runner = _setup(1, 1, 8, size=64)
    layer = Layer(0, 1, 1, 8, 8**-0.5)
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    pool.k_buffer[0][1:] = float("nan")
    pool.v_buffer[0][1:] = float("nan")
    rows = runner.req_to_token_pool.alloc(2)
    table[rows[0], :10] = torch.arange(20, 30, dtype=torch.int32)  # stale entries of a long request
    loc = torch.tensor([5, 6])
    table[rows[0], 0] = 5
    table[rows[1], :3] = torch.tensor([6, 7, 8], dtype=torch.int32)
    pool.set_kv_buffer(0, torch.tensor([5, 6, 7, 8]), torch.randn(4, 1, 8), torch.randn(4, 1, 8))
    fb = ForwardBatch.create_decode(runner, torch.zeros(2), [1, 3], torch.tensor(rows), loc)
    runner.attn_backend.init_forward_metadata(fb)
    out = runner.attn_backend.forward_decode(torch.randn(2, 8), layer, fb)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cuda_backend_keeps_sdpa_off_cudnn_and_cpu_leaves_it(device):
    """On CUDA, SDPA's cuDNN kernels re-plan for every new sequence length (62 ms per eager decode
    step measured on an H200): a CUDA torch_native backend turns them off, a CPU one leaves the flag."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        TorchNativeAttnBackend(device)  # builds nothing on the device without a kv_dtype
        assert torch.backends.cuda.cudnn_sdp_enabled() is (device == "cpu")
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
