"""The C++ CPU decode attention (`kernels/cpu`) reads the paged KV pool in place and equals dense
attention over each request's keys and the torch path; without a build, the torch path serves."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from kernels.attention import create_attention_backend
from kernels.attention import torch_native_backend
from kernels.attention.torch_native_backend import TorchNativeAttnBackend
from kernels.cpu import build
from kernels.cpu.paged_attention import paged_decode_op
from mem_cache.memory_pool import MHATokenToKVPool
from srt.model_executor.forward_batch_info import ForwardBatch

from paged_attention_utils import Layer, Layout, make_backend_runner, make_layout

F32, BF16 = torch.float32, torch.bfloat16
LENGTHS = {
    "one_token": [1],
    "batch_of_one_long": [1100],
    "ragged": [1, 7, 16, 17, 255, 256, 257, 513, 40],
    "many": [int(x) for x in torch.randint(1, 300, (33,), generator=torch.Generator().manual_seed(3))],
}


@pytest.fixture(scope="module")
def op():
    fn = paged_decode_op("cpu", F32, F32)
    assert fn is not None, "the C++ CPU kernels did not build here (see the warning logged above)"
    return fn


def dense_attention(q: torch.Tensor, layout: Layout, scale: float) -> torch.Tensor:
    """Oracle in float64: softmax(q K^T * scale) V over each request's own keys."""
    out = []
    for b in range(q.shape[0]):
        s = layout.slots(b)
        group = q.shape[1] // layout.k.shape[1]
        keys = layout.k[s].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        vals = layout.v[s].double().repeat_interleave(group, dim=1).transpose(0, 1)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,hnd->hd", p, vals))
    return torch.stack(out)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (12, 4)], ids=["mha", "gqa4", "gqa3"])
@pytest.mark.parametrize("case", sorted(LENGTHS))
def test_fp32_decode_matches_dense_attention(op, page_size, heads, kv_heads, case):
    lens = LENGTHS[case]
    layout = make_layout(lens, page_size, kv_heads, 64, seed=len(lens) + page_size)
    q = torch.randn(len(lens), heads, 64)
    out = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.125)
    assert out.shape == q.shape and out.dtype == F32
    assert torch.isfinite(out).all(), "read a slot past some request's seq_len"
    torch.testing.assert_close(out.double(), dense_attention(q, layout, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_dtype,kv_dtype", [(BF16, BF16), (F32, BF16), (BF16, F32)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_bf16_decode_matches_dense_attention(op, q_dtype, kv_dtype, page_size):
    lens = LENGTHS["ragged"]
    layout = make_layout(lens, page_size, 2, 64, dtype=kv_dtype, seed=5)
    q = torch.randn(len(lens), 8, 64).to(q_dtype)
    out = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.125)
    assert out.dtype == q_dtype
    # The oracle sees the same rounded inputs: fp32 output differs by accumulation order only,
    # bf16 output by its final rounding (8 bits of mantissa).
    tol = 1e-5 if q_dtype == F32 else 1e-2
    torch.testing.assert_close(out.double(), dense_attention(q, layout, 0.125), rtol=tol, atol=tol)


def test_odd_head_dim_uses_the_scalar_tails(op):
    layout = make_layout([3, 40, 300], 1, 2, 20, seed=9)
    q = torch.randn(3, 6, 20)
    out = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 20**-0.5)
    torch.testing.assert_close(out.double(), dense_attention(q, layout, 20**-0.5), rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_or_in_a_batch(op):
    layout = make_layout(LENGTHS["ragged"], 16, 2, 64, seed=11)
    q = torch.randn(len(LENGTHS["ragged"]), 8, 64)
    batch = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.125)
    for b in (0, 6, 7):
        alone = op(q[b : b + 1], layout.k, layout.v, layout.req_to_token, layout.rows[b : b + 1],
                   layout.seq_lens[b : b + 1], 0.125)
        assert torch.equal(alone[0], batch[b]), f"row {b}"


def share_prefixes(layout: Layout, groups) -> Layout:
    """Each group (lead, member, prefix length) gives `member` the lead's first slots, as the radix
    cache does for requests that match one cached prefix; the member's own slots past it stay."""
    table = layout.req_to_token.clone()
    for lead, member, n in groups:
        table[layout.rows[member], :n] = table[layout.rows[lead], :n]
    return Layout(layout.k, layout.v, table, layout.rows, layout.seq_lens)


# Requests 0-3 share a 700-token prefix (splits 0 and 1 are whole, split 2 diverges at 700);
# 4 shares 256 with 5 (exactly one split); 6 is 5's twin (same length, every slot shared); 7
# shares only its first 100 slots with 0, so it starts split 0 like 0 but must not join 0's task.
SHARED_LENS = [1100, 900, 701, 768, 300, 257, 257, 400]
SHARED_GROUPS = [(0, 1, 700), (0, 2, 700), (0, 3, 700), (4, 5, 256), (5, 6, 257), (0, 7, 100)]


@pytest.mark.parametrize("q_dtype,kv_dtype", [(F32, F32), (BF16, BF16), (F32, BF16)])
@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_sharing_a_prefix_get_their_unshared_bits_and_the_dense_answer(op, q_dtype, kv_dtype, page_size):
    layout = share_prefixes(make_layout(SHARED_LENS, page_size, 3, 64, dtype=kv_dtype, seed=21), SHARED_GROUPS)
    q = torch.randn(len(SHARED_LENS), 9, 64).to(q_dtype)
    args = (q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.125)
    shared, alone = op(*args), op(*args, share_prefixes=False)
    assert torch.equal(shared, alone), "a request's result depends on whom it shares a prefix with"
    tol = 1e-5 if q_dtype == F32 else 1e-2
    torch.testing.assert_close(shared.double(), dense_attention(q, layout, 0.125), rtol=tol, atol=tol)


@pytest.mark.parametrize("kv_dtype", [F32, BF16])
def test_kv_buffers_with_padded_heads_are_read_head_by_head(op, kv_dtype):
    # A slot's heads not back to back (a view of wider rows): no run of slots is one copy.
    base = make_layout(LENGTHS["ragged"], 1, 2, 64, dtype=kv_dtype, seed=13)
    wide_k = torch.full((base.k.shape[0], 2, 72), float("nan"), dtype=kv_dtype)
    wide_v = wide_k.clone()
    wide_k[..., :64], wide_v[..., :64] = base.k, base.v
    layout = Layout(wide_k[..., :64], wide_v[..., :64], base.req_to_token, base.rows, base.seq_lens)
    assert layout.k.stride(1) == 72
    q = torch.randn(len(LENGTHS["ragged"]), 6, 64)
    out = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.125)
    dense = op(q, base.k, base.v, base.req_to_token, base.rows, base.seq_lens, 0.125)
    assert torch.equal(out, dense)
    torch.testing.assert_close(out.double(), dense_attention(q, base, 0.125), rtol=1e-5, atol=1e-5)


def test_splits_over_the_same_slots_become_one_task():
    layout = share_prefixes(make_layout(SHARED_LENS, 1, 3, 64, seed=21), SHARED_GROUPS)
    members = torch.ops.srt_cpu.paged_decode_task_members
    args = (layout.req_to_token, layout.rows, layout.seq_lens)
    alone = members(*args, share_prefixes=False)
    splits = sum(math.ceil(n / 256) for n in SHARED_LENS)
    assert alone.tolist() == [1] * splits
    shared = members(*args)
    assert shared.sum().item() == splits, "every split runs exactly once"
    # Splits 0 and 1 of requests 0-3 (four members each), split 0 of 4-6 and split 1 of 5-6
    # (257 keys: one key in split 1); 7's split 0 starts on 0's slot but diverges at 100.
    assert sorted(shared.tolist(), reverse=True) == [4, 4, 3, 2] + [1] * (splits - 13)


def test_a_slot_outside_the_pool_raises(op):
    layout = make_layout([5], 1, 1, 16)
    layout.req_to_token[layout.rows[0], 2] = layout.k.shape[0]
    with pytest.raises(RuntimeError, match="outside the pool"):
        op(torch.randn(1, 1, 16), layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.25)


def test_a_seq_len_beyond_the_table_raises(op):
    layout = make_layout([5], 1, 1, 16)
    too_long = torch.tensor([layout.req_to_token.shape[1] + 1])
    with pytest.raises(RuntimeError, match="seq_lens"):
        op(torch.randn(1, 1, 16), layout.k, layout.v, layout.req_to_token, layout.rows, too_long, 0.25)


def test_the_op_traces_under_torch_compile(op):
    layout = make_layout([3, 30], 1, 2, 16, seed=2)
    q = torch.randn(2, 4, 16)

    def attend(x):
        return op(x * 1.0, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, 0.25) + 0.0

    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(q), attend(q), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- backend level


def _decode_steps(runner, alloc, layer, prompt_lens, steps, seed):
    """Extend `prompt_lens`, then `steps` decodes; returns every decode step's output."""
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, D = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    dtype = runner.token_to_kv_pool.dtype
    backend, table = runner.attn_backend, runner.req_to_token_pool.req_to_token
    rows = runner.req_to_token_pool.alloc(len(prompt_lens))
    loc = alloc.alloc_extend([0] * len(rows), prompt_lens, [0] * len(rows))
    off = 0
    for row, n in zip(rows, prompt_lens):
        table[row, :n] = loc[off : off + n].int()
        off += n
    fb = ForwardBatch.create_extend(runner, [[0] * n for n in prompt_lens], [0] * len(rows), rows, loc)
    backend.init_forward_metadata(fb)
    n = sum(prompt_lens)
    backend.forward(torch.randn(n, H * D, generator=gen).to(dtype), torch.randn(n, Hkv, D, generator=gen).to(dtype),
                    torch.randn(n, Hkv, D, generator=gen).to(dtype), layer, fb)
    seq, outs = list(prompt_lens), []
    for _ in range(steps):
        seq_t, rows_t = torch.tensor(seq), torch.tensor(rows)
        dec = alloc.alloc_decode(seq_t + 1, table[rows_t, seq_t - 1].long())
        table[rows_t, seq_t] = dec.int()
        seq = [s + 1 for s in seq]
        fb = ForwardBatch.create_decode(runner, torch.zeros(len(rows)), seq, rows, dec)
        backend.init_forward_metadata(fb)
        bs = len(rows)
        outs.append(backend.forward(torch.randn(bs, H * D, generator=gen).to(dtype),
                                    torch.randn(bs, Hkv, D, generator=gen).to(dtype),
                                    torch.randn(bs, Hkv, D, generator=gen).to(dtype), layer, fb))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_backend_decode_with_the_op_matches_the_torch_path(op, page_size, dtype):
    layer = Layer(0, 8, 2, 32, 32**-0.5)
    lens = [1, 37, 300, 5]
    results = {}
    for name, backend in (("torch", TorchNativeAttnBackend()), ("op", TorchNativeAttnBackend("cpu", dtype, dtype))):
        torch.manual_seed(0)  # the same allocator shuffle on both sides
        alloc, runner = make_backend_runner(page_size, 2, 32, dtype, backend)
        results[name] = _decode_steps(runner, alloc, layer, lens, steps=3, seed=1)
        assert backend.use_paged_decode == (name == "op")
    tol = 1e-5 if dtype == F32 else 1e-2
    for got, want in zip(results["op"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_backend_keeps_the_torch_path_when_the_op_is_unavailable(monkeypatch):
    monkeypatch.setattr(torch_native_backend, "paged_decode_op", lambda *args: None)
    backend = TorchNativeAttnBackend("cpu", F32, F32)
    assert backend.paged_decode is None
    layer = Layer(0, 4, 2, 16, 0.25)
    alloc, runner = make_backend_runner(1, 2, 16, F32, backend)
    outs = _decode_steps(runner, alloc, layer, [4, 9], steps=1, seed=2)
    assert not backend.use_paged_decode and torch.isfinite(outs[0]).all()


def test_create_attention_backend_enables_the_op_only_for_fp32_and_bf16_pools(op):
    def backend_for(dtype, store_dtype):
        pool = MHATokenToKVPool(16, 1, dtype, store_dtype, 1, 8, 1)
        return create_attention_backend("torch_native", SimpleNamespace(device="cpu", token_to_kv_pool=pool))

    assert backend_for(F32, F32).paged_decode is not None
    assert backend_for(BF16, BF16).paged_decode is not None
    assert backend_for(F32, torch.float8_e4m3fn).paged_decode is None
    assert backend_for(torch.float16, torch.float16).paged_decode is None


def test_the_op_is_not_offered_for_cuda_devices():
    assert paged_decode_op("cuda", F32, F32) is None
    assert paged_decode_op("cuda:0", BF16, BF16) is None


# ---------------------------------------------------------------- build fallback


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    def fail():
        raise build.KernelBuildError("error: no such instruction")

    monkeypatch.setattr(build, "build_and_load", fail)
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_cpu_kernels.__wrapped__() is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch path" in warnings[0].getMessage()


def test_a_missing_compiler_falls_back_without_trying_to_build(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(build, "build_and_load", lambda: pytest.fail("must not build without a compiler"))
    with caplog.at_level(logging.WARNING, logger=build.__name__):
        assert build.load_cpu_kernels.__wrapped__() is False
    assert "/nonexistent/c++" in caplog.text and "torch path" in caplog.text


# bf16 queries and KV take the op's bf16 path where the CPU has AVX512-BF16 (K rows transposed by
# pairs and scored with vdpbf16ps, V rows read in place): every query-row tile (1-4 rows per kv
# head, and more through shared members), head dims of one, two and four 32-element pair blocks,
# and blocks cut short by a request's end.
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(2, 2, 64), (4, 2, 64), (9, 3, 64), (8, 2, 128), (10, 2, 32),
                                                 (12, 2, 64)])
def test_bf16_decode_every_group_and_head_dim_matches_dense_attention(op, page_size, heads, kv_heads, dim):
    lens = LENGTHS["ragged"]
    layout = make_layout(lens, page_size, kv_heads, dim, dtype=BF16, seed=heads + dim)
    q = (torch.randn(len(lens), heads, dim) * 2).to(BF16)
    scale = dim**-0.5
    out = op(q, layout.k, layout.v, layout.req_to_token, layout.rows, layout.seq_lens, scale)
    want = dense_attention(q, layout, scale)
    # Exact bf16 products summed in fp32, then one rounding to bf16: within a bf16 ulp or two.
    err = (out.double() - want).abs()
    assert (err <= 2**-7 * want.abs() + 2e-3).all(), f"max error {err.max().item():.2e}"
    for b in (0, 4, 7):
        alone = op(q[b : b + 1], layout.k, layout.v, layout.req_to_token, layout.rows[b : b + 1],
                   layout.seq_lens[b : b + 1], scale)
        assert torch.equal(alone[0], out[b]), f"row {b} depends on the rows beside it"
