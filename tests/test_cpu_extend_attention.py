"""The C++ CPU extend attention (`kernels/cpu`) reads each request's cached prefix and new tokens
in place through `req_to_token`, causally, and equals dense attention and the torch path."""

from __future__ import annotations

import pytest
import torch

from kernels.attention import torch_native_backend
from kernels.attention.torch_native_backend import TorchNativeAttnBackend
from kernels.cpu.paged_attention import paged_extend_op
from srt.model_executor.forward_batch_info import ForwardBatch

from paged_attention_utils import Layer, Layout, make_backend_runner, make_layout

F32, BF16 = torch.float32, torch.bfloat16
# (cached prefix, new tokens) per request: empty prefixes, one new token, blocks of 32 keys and
# tasks of 64 new tokens cut at odd places, one long prefix.
BATCHES = {
    "one_token": [(0, 1)],
    "prefill": [(0, 300)],
    "decode_like": [(40, 1), (7, 1)],
    "ragged": [(0, 5), (31, 2), (32, 33), (100, 64), (3, 65), (0, 129), (17, 1)],
    "long_prefix": [(1100, 64), (1024, 7)],
}


@pytest.fixture(scope="module")
def op():
    fn = paged_extend_op("cpu", F32, F32)
    assert fn is not None, "the C++ CPU kernels did not build here (see the warning logged above)"
    return fn


def make_inputs(batch, page_size, heads, kv_heads, dim, q_dtype=F32, kv_dtype=F32, seed=0):
    """A shuffled paged pool holding every request's prefix and new tokens (stale table entries
    point at NaN pages) and q for the new tokens, requests back to back."""
    layout = make_layout([p + e for p, e in batch], page_size, kv_heads, dim, dtype=kv_dtype, seed=seed)
    prefix = torch.tensor([p for p, _ in batch])
    ext = torch.tensor([e for _, e in batch])
    q = torch.randn(int(ext.sum()), heads, dim, generator=torch.Generator().manual_seed(seed + 1)).to(q_dtype)
    return layout, prefix, ext, q


def dense_extend(q, layout: Layout, prefix, ext, scale):
    """Oracle in float64: token t of request b sees keys [0, prefix[b] + t] of its own row."""
    out, start = [], 0
    group = q.shape[1] // layout.k.shape[1]
    for b in range(len(prefix)):
        p, e = int(prefix[b]), int(ext[b])
        s = layout.slots(b)
        keys = layout.k[s].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        vals = layout.v[s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[start : start + e].double().transpose(0, 1)  # [H, e, D]
        scores = qb @ keys.transpose(1, 2) * scale
        visible = torch.arange(p + e)[None, :] <= torch.arange(p, p + e)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ vals).transpose(0, 1))
        start += e
    return torch.cat(out)


def run_op(op, q, layout, prefix, ext, scale=0.125):
    return op(q, layout.k, layout.v, layout.req_to_token, layout.rows, prefix, ext, scale)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (9, 3)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("case", sorted(BATCHES))
def test_fp32_extend_matches_dense_causal_attention(op, page_size, heads, kv_heads, case):
    batch = BATCHES[case]
    layout, prefix, ext, q = make_inputs(batch, page_size, heads, kv_heads, 64, seed=len(batch) + page_size)
    out = run_op(op, q, layout, prefix, ext)
    assert out.shape == q.shape and out.dtype == F32
    assert torch.isfinite(out).all(), "read a slot past some request's prefix + extend"
    torch.testing.assert_close(out.double(), dense_extend(q, layout, prefix, ext, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dim", [16, 20, 40, 128])
def test_head_dims_with_and_without_whole_vectors(op, dim):
    batch = BATCHES["ragged"]
    layout, prefix, ext, q = make_inputs(batch, 1, 4, 2, dim, seed=dim)
    out = run_op(op, q, layout, prefix, ext, dim**-0.5)
    torch.testing.assert_close(out.double(), dense_extend(q, layout, prefix, ext, dim**-0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(BF16, BF16), (F32, BF16), (BF16, F32)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_bf16_extend_matches_dense_causal_attention(op, q_dtype, kv_dtype, page_size):
    batch = BATCHES["ragged"]
    layout, prefix, ext, q = make_inputs(batch, page_size, 8, 2, 64, q_dtype, kv_dtype, seed=5)
    out = run_op(op, q, layout, prefix, ext)
    assert out.dtype == q_dtype
    # The oracle sees the same rounded inputs: fp32 output differs by accumulation order only,
    # bf16 output by its final rounding.
    tol = 1e-5 if q_dtype == F32 else 1e-2
    torch.testing.assert_close(out.double(), dense_extend(q, layout, prefix, ext, 0.125), rtol=tol, atol=tol)


def test_a_request_gets_the_same_bits_alone_or_in_a_batch(op):
    batch = BATCHES["ragged"]
    layout, prefix, ext, q = make_inputs(batch, 1, 8, 2, 64, seed=9)
    together = run_op(op, q, layout, prefix, ext)
    start = int(ext[:3].sum())
    alone = op(q[start : start + int(ext[3])], layout.k, layout.v, layout.req_to_token, layout.rows[3:4],
               prefix[3:4], ext[3:4], 0.125)
    assert torch.equal(alone, together[start : start + int(ext[3])])


def test_a_non_contiguous_q_view_is_read_through_its_strides(op):
    batch = BATCHES["ragged"]
    layout, prefix, ext, q = make_inputs(batch, 16, 8, 2, 64, seed=4)
    qkv = torch.cat([q, torch.randn_like(q)], dim=1)  # q is the first half of each token's heads
    out = run_op(op, qkv[:, :8], layout, prefix, ext)
    torch.testing.assert_close(out, run_op(op, q, layout, prefix, ext), rtol=0, atol=0)


# ---------------------------------------------------------------- bad inputs


def test_a_slot_outside_the_pool_raises(op):
    layout, prefix, ext, q = make_inputs([(3, 4)], 1, 2, 1, 16)
    layout.req_to_token[layout.rows[0], 5] = layout.k.shape[0]
    with pytest.raises(RuntimeError, match="KV slot outside the pool of"):
        run_op(op, q, layout, prefix, ext)


def test_an_extend_beyond_the_table_raises(op):
    layout, prefix, ext, q = make_inputs([(3, 4)], 1, 2, 1, 16)
    width = layout.req_to_token.shape[1]
    with pytest.raises(RuntimeError, match=f"prefix {width} \\+ extend 4 must be a non-empty extend within the "
                                           f"table's {width} columns"):
        run_op(op, q, layout, torch.tensor([width]), ext)


def test_q_tokens_must_match_the_extend_lengths(op):
    layout, prefix, ext, q = make_inputs([(3, 4), (0, 2)], 1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="q has 5 tokens, extend_lens sum to 6"):
        run_op(op, q[:5], layout, prefix, ext)


def test_an_empty_extend_raises(op):
    layout, prefix, ext, q = make_inputs([(3, 4)], 1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="request 0: prefix 3 \\+ extend 0 must be a non-empty extend"):
        run_op(op, q[:0], layout, prefix, torch.tensor([0]))


def test_int32_lengths_are_refused_by_name(op):
    layout, prefix, ext, q = make_inputs([(3, 4)], 1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="req_pool_indices, prefix_lens and extend_lens must be int64"):
        run_op(op, q, layout, prefix.int(), ext)


def test_the_op_traces_under_torch_compile(op):
    layout, prefix, ext, q = make_inputs([(5, 3), (0, 9)], 1, 2, 1, 16, seed=2)

    def attend(x):
        return run_op(op, x * 1.0, layout, prefix, ext, 0.25) + 0.0

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q), attend(q), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- backend level


def _chunked_prefill(runner, alloc, layer, chunks, seed):
    """Each request's prompt in chunks (`chunks[i]` = its chunk sizes), one extend step per round
    over the requests with a chunk left, each step over the cached prefix; returns every step's output."""
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    dtype = runner.token_to_kv_pool.dtype
    backend, table = runner.attn_backend, runner.req_to_token_pool.req_to_token
    rows = runner.req_to_token_pool.alloc(len(chunks))
    done = [0] * len(chunks)
    outs = []
    for step in range(max(len(c) for c in chunks)):
        live = [i for i, c in enumerate(chunks) if step < len(c)]
        prefix = [done[i] for i in live]
        ext = [chunks[i][step] for i in live]
        last = [int(table[rows[i], done[i] - 1]) if done[i] else 0 for i in live]
        loc = alloc.alloc_extend(prefix, [p + e for p, e in zip(prefix, ext)], last)
        off = 0
        for i, e in zip(live, ext):
            table[rows[i], done[i] : done[i] + e] = loc[off : off + e].int()
            off += e
            done[i] += e
        fb = ForwardBatch.create_extend(runner, [[0] * e for e in ext], prefix, [rows[i] for i in live], loc)
        backend.init_forward_metadata(fb)
        n = sum(ext)
        outs.append(backend.forward(torch.randn(n, H * D, generator=gen).to(dtype),
                                    torch.randn(n, Hkv, D, generator=gen).to(dtype),
                                    torch.randn(n, Hkv, D, generator=gen).to(dtype), layer, fb))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_backend_extend_with_the_op_matches_the_torch_path(op, page_size, dtype):
    layer = Layer(0, 9, 3, 64, 0.125)
    chunks = [[300, 64, 1], [5, 100], [1, 1, 1], [64, 65, 33]]
    results = {}
    for name, backend in (("torch", TorchNativeAttnBackend()), ("op", TorchNativeAttnBackend("cpu", dtype, dtype))):
        torch.manual_seed(0)  # the same allocator shuffle on both sides
        alloc, runner = make_backend_runner(page_size, 3, 64, dtype, backend)
        results[name] = _chunked_prefill(runner, alloc, layer, chunks, seed=1)
        assert (backend.paged_extend is not None) == (name == "op")
    tol = 1e-5 if dtype == F32 else 1e-2
    for got, want in zip(results["op"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_backend_extend_keeps_the_torch_path_when_the_op_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch_native_backend, "paged_extend_op", lambda *args: None)
    backend = TorchNativeAttnBackend("cpu", F32, F32)
    assert backend.paged_extend is None and backend.paged_decode is not None
    layer = Layer(0, 4, 2, 16, 0.25)
    alloc, runner = make_backend_runner(1, 2, 16, F32, backend)
    outs = _chunked_prefill(runner, alloc, layer, [[5, 3], [9]], seed=2)
    assert len(backend.extend_rows) == 1 and backend.extend_lens is None  # the per-request SDPA path ran
    assert all(torch.isfinite(o).all() for o in outs)
