"""Fused C++ CPU ops (RMSNorm with residual, SiLU-and-mul, RoPE) against the torch code they
replace (the oracle), and a whole model with them against the same model without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.elementwise import load_fused_ops
from model_utils import assert_pool_conserved, greedy_run, make_runner, random_prompts
from srt.layers import cpu_fused_ops
from srt.layers.rotary_embedding import RotaryEmbedding

pytestmark = pytest.mark.skipif(not load_fused_ops(), reason="the C++ CPU kernels cannot build here")
ops = torch.ops.srt_cpu
F32, BF16 = torch.float32, torch.bfloat16
# fp32: the RMS sum is added in another order (one ulp of the scale); bf16: that ulp can move a
# rounding by one bf16 step on rare elements.
TOL = {F32: dict(rtol=2e-6, atol=2e-6), BF16: dict(rtol=8e-3, atol=8e-3)}


def _rms_norm_ref(x, residual, weight, eps):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out, residual


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 576), (300, 100), (5, 7)])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_equals_torch(dtype, rows, hidden, with_residual):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    out, new_residual = ops.rms_norm(x, residual, weight, 1e-5)
    ref, ref_residual = _rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if with_residual:
        assert torch.equal(new_residual, ref_residual)  # one rounded add: exact


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,d", [(1, 16), (33, 1536), (4, 13)])
def test_silu_and_mul_equals_torch(dtype, rows, d):
    x = (3 * torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d))).to(dtype)
    x[0, 0], x[-1, d - 1] = -100.0, 100.0  # the clamped ends of the exp
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :d]) * x[:, d:], **TOL[dtype])


def test_silu_and_mul_reads_a_strided_row_view():
    base = torch.randn(6, 40)
    x = base[:, :32]  # rows 40 apart
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :16]) * x[:, 16:], **TOL[F32])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_equals_torch_on_split_qkv_views(dtype, head_dim):
    """q and k as the model hands them over: views of one fused qkv row (strided)."""
    n, heads, kv_heads = 19, 6, 2
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(n, heads, head_dim), k.reshape(n, kv_heads, head_dim)
    positions = torch.randint(0, 512, (n,), generator=g)
    got_q, got_k = ops.rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache)
    cos, sin = rope.cos_cache[positions].unsqueeze(1), rope.sin_cache[positions].unsqueeze(1)
    ref_q = q * cos + RotaryEmbedding._rotate_half(q) * sin
    ref_k = k * cos + RotaryEmbedding._rotate_half(k) * sin
    torch.testing.assert_close(got_q, ref_q, rtol=0, atol=0)
    torch.testing.assert_close(got_k, ref_k, rtol=0, atol=0)


def test_rope_refuses_a_position_past_the_table():
    rope = RotaryEmbedding(8, 16, 10000.0, None, F32)
    q, k = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the RoPE table of 16 rows"):
        ops.rotary_embedding(torch.tensor([3, 16]), q, k, rope.cos_cache, rope.sin_cache)


def test_bad_shapes_are_refused_with_the_shape():
    with pytest.raises(RuntimeError, match="last dim must be even"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.randn(2, 8), None, torch.ones(4), 1e-6)


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen3", "float32"), ("llama", "bfloat16")])
def test_model_with_fused_ops_matches_the_torch_ops(tiny_model_factory, monkeypatch, arch, dtype):
    """qwen3 also normalises q and k per head (3-D input to RMSNorm)."""
    path = tiny_model_factory(arch)
    prompts = random_prompts(500, (5, 40, 17), seed=11)
    fused = make_runner(path, dtype=dtype)
    toks, logits = greedy_run(fused, prompts, steps=10)
    monkeypatch.setattr(cpu_fused_ops, "_enabled", lambda: False)
    plain = make_runner(path, dtype=dtype)
    ref_toks, ref_logits = greedy_run(plain, prompts, steps=10)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(logits, ref_logits, **tol)
    if dtype == "float32":
        assert toks == ref_toks
    assert_pool_conserved(fused)
    assert_pool_conserved(plain)


def test_layers_trace_into_one_graph_under_torch_compile():
    """Under torch.compile the layers take their torch code (inductor fuses it): dynamo traced into
    the kernels' build check (file and PATH lookups), broke the graph at every norm and recompiled
    per layer until its limit, so a 30-layer decode ran 2.5x slower compiled than eager.
    fullgraph=True raises on any graph break."""
    from srt.layers.activation import SiluAndMul
    from srt.layers.layernorm import RMSNorm

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(5, 64, generator=g, device="cpu"), torch.randn(5, 64, generator=g, device="cpu")
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.data = 1 + 0.1 * torch.randn(64, generator=g, device="cpu")
    rope = RotaryEmbedding(16, 64, 10000.0)
    q, k = torch.randn(5, 4, 16, generator=g, device="cpu"), torch.randn(5, 2, 16, generator=g, device="cpu")
    positions = torch.tensor([0, 3, 7, 9, 63], device="cpu")

    def layer(x, residual, q, k):
        h, res = norm(x, residual)
        rq, rk = rope(positions, q.clone(), k.clone())
        return norm(h), res, SiluAndMul()(torch.cat([h, res], dim=-1)), rq, rk

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, residual, q, k), layer(x, residual, q, k)):
        torch.testing.assert_close(got, want, **TOL[F32])
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [F32, BF16, torch.uint8], ids=["fp32", "bf16", "fp8-bytes"])
@pytest.mark.parametrize("n", [1, 16, 700])
def test_store_kv_equals_index_copy(dtype, n):
    """The pool's K/V write: rows from a split qkv view (strided), int64 and int32 slots."""
    g = torch.Generator().manual_seed(n)
    slots, kv_heads, dim = 1024, 2, 24
    k_ref = (100 * torch.randn(slots, kv_heads, dim, generator=g, device="cpu")).to(dtype)
    v_ref = (100 * torch.randn(slots, kv_heads, dim, generator=g, device="cpu")).to(dtype)
    qkv = (100 * torch.randn(n, 8 * dim, generator=g, device="cpu")).to(dtype)
    k = qkv[:, 4 * dim : 6 * dim].reshape(n, kv_heads, dim)
    v = qkv[:, 6 * dim :].reshape(n, kv_heads, dim)
    loc = torch.randperm(slots, generator=g, device="cpu")[:n]
    for index in (loc, loc.to(torch.int32)):
        k_buf, v_buf = k_ref.clone(), v_ref.clone()
        ops.store_kv(k_buf, v_buf, index, k, v)
        assert torch.equal(k_buf, k_ref.clone().index_copy_(0, loc, k))
        assert torch.equal(v_buf, v_ref.clone().index_copy_(0, loc, v))


def test_store_kv_writes_a_buffer_with_padded_heads_head_by_head():
    wide_k, wide_v = torch.zeros(64, 2, 40, device="cpu"), torch.zeros(64, 2, 40, device="cpu")
    k_buf, v_buf = wide_k[..., :32], wide_v[..., :32]  # a slot's heads 40 apart
    k, v = torch.randn(5, 2, 32, device="cpu"), torch.randn(5, 2, 32, device="cpu")
    loc = torch.tensor([9, 0, 63, 17, 4], device="cpu")
    ops.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    assert not wide_k[..., 32:].any() and not wide_v[..., 32:].any(), "wrote past a head"


def test_store_kv_refuses_a_slot_outside_the_pool_before_writing():
    k_buf, v_buf = torch.zeros(8, 1, 4, device="cpu"), torch.zeros(8, 1, 4, device="cpu")
    with pytest.raises(RuntimeError, match="slot 8 \\(row 1\\) outside the pool of 8 slots"):
        ops.store_kv(k_buf, v_buf, torch.tensor([3, 8], device="cpu"), torch.ones(2, 1, 4, device="cpu"),
                     torch.ones(2, 1, 4, device="cpu"))
    assert not k_buf.any() and not v_buf.any(), "wrote a row before refusing"
    with pytest.raises(RuntimeError, match=r"must have the buffers' dtype \(Float / Float\), got BFloat16 / Float"):
        ops.store_kv(k_buf, v_buf, torch.tensor([3], device="cpu"), torch.ones(1, 1, 4, dtype=BF16, device="cpu"),
                     torch.ones(1, 1, 4, device="cpu"))
    with pytest.raises(RuntimeError, match=r"rows \[2, 2, 4\] / \[2, 1, 4\] do not fit buffers \[8, 1, 4\]"):
        ops.store_kv(k_buf, v_buf, torch.tensor([1, 2], device="cpu"), torch.ones(2, 2, 4, device="cpu"),
                     torch.ones(2, 1, 4, device="cpu"))
