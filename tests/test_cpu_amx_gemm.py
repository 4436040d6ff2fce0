"""bf16 linears on AMX tiles (kernels/cpu/csrc/amx_gemm.cpp): the tile layout, the product against
an fp32 matmul of the same bf16 numbers (the oracle), rows independent of the rows beside them,
the refusals, and a bf16 model packed into tiles against its dense self."""

from __future__ import annotations

import pytest
import torch

from model_utils import assert_bf16_close_to_dense, assert_pool_conserved, make_runner, random_prompts
from kernels.cpu.gemm import amx_fits, load_amx_ops
from srt.layers import cpu_weight_packing
from srt.layers.cpu_weight_packing import pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not load_amx_ops(), reason="needs a CPU (and build) with AMX tiles")
ops = torch.ops.srt_cpu if load_amx_ops() else None


def _weight(n, k, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(n, k, generator=g, device="cpu") * 0.05).bfloat16()


def test_tiles_hold_input_pairs_of_sixteen_columns():
    w = _weight(48, 96)
    t = ops.convert_weight_amx(w)
    assert t.shape == (3, 3, 16, 16, 2)
    for n, k in [(0, 0), (17, 33), (47, 95), (31, 64), (5, 62)]:
        assert t[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == w[n, k]


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("n,k", [(16, 32), (80, 96), (512, 256), (1536, 64)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_fp32_output_equals_the_fp32_product_of_the_bf16_numbers(rows, n, k, bias):
    w = _weight(n, k)
    x = torch.randn(rows, k, device="cpu", generator=torch.Generator(device="cpu").manual_seed(1)).bfloat16()
    b = torch.randn(n, device="cpu", generator=torch.Generator(device="cpu").manual_seed(2)) if bias else None
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    out = ops.amx_linear(x, ops.convert_weight_amx(w), b, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # bf16 output: the fp32 result rounded once.
    out16 = ops.amx_linear(x, ops.convert_weight_amx(w), b, None)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, out.bfloat16())


def test_a_row_is_the_same_alone_and_among_others():
    """Every output is the same chain of tile products over K whatever the batch (decode's one
    row tile or prefill's two), so a request's logits never depend on who shares its batch."""
    w = _weight(96, 256)
    t = ops.convert_weight_amx(w)
    x = torch.randn(70, 256, device="cpu", generator=torch.Generator(device="cpu").manual_seed(3)).bfloat16()
    full = ops.amx_linear(x, t, None, torch.float32)
    for i in (0, 15, 16, 45, 69):
        assert torch.equal(ops.amx_linear(x[i : i + 1], t, None, torch.float32)[0], full[i])
    assert torch.equal(ops.amx_linear(x[10:20], t, None, torch.float32), full[10:20])


def test_packed_linear_runs_tiles_for_batched_inputs_and_keeps_onednn_for_other_shapes():
    w = _weight(64, 96)
    tiles = pack_weight(w, amx=True)
    assert tiles.dim() == 5 and not tiles.is_mkldnn
    x = torch.randn(2, 3, 96, device="cpu").bfloat16()
    out = packed_linear(x, tiles, out_dtype=torch.float32)
    torch.testing.assert_close(out, (x.float() @ w.float().t()), rtol=1e-5, atol=1e-5)
    assert not amx_fits(_weight(60, 96)) and not amx_fits(_weight(64, 100))
    assert pack_weight(_weight(60, 96), amx=True).is_mkldnn  # not whole tiles: oneDNN's layout


def test_bad_inputs_are_refused_with_what_was_given():
    t = ops.convert_weight_amx(_weight(32, 64))
    with pytest.raises(RuntimeError, match=r"x has 32 features, the weight 64"):
        ops.amx_linear(torch.zeros(2, 32, dtype=torch.bfloat16, device="cpu"), t, None, None)
    with pytest.raises(RuntimeError, match=r"x must be a bf16 \[M, K\]"):
        ops.amx_linear(torch.zeros(2, 64, device="cpu"), t, None, None)
    with pytest.raises(RuntimeError, match=r"N must be a multiple of 16 and K of 32, got 20 x 64"):
        ops.convert_weight_amx(_weight(20, 64))
    with pytest.raises(RuntimeError, match=r"bias has 3 values for 32 outputs"):
        ops.amx_linear(torch.zeros(2, 64, dtype=torch.bfloat16, device="cpu"), t, torch.zeros(3, device="cpu"), None)


def test_gemm_choice_puts_bf16_on_tiles_unless_switched_off(monkeypatch):
    assert cpu_weight_packing.uses_amx_gemm("cpu", torch.bfloat16)  # auto, AMX
    assert not cpu_weight_packing.uses_amx_gemm("cpu", torch.float32)
    assert not cpu_weight_packing.uses_amx_gemm("cuda:0", torch.bfloat16)
    monkeypatch.setenv("SRT_CPU_GEMM", "onednn")
    assert not cpu_weight_packing.uses_amx_gemm("cpu", torch.bfloat16)
    monkeypatch.setenv("SRT_CPU_GEMM", "amx")
    assert cpu_weight_packing.uses_amx_gemm("cpu", torch.bfloat16)
    assert not cpu_weight_packing.uses_panel_gemm("cpu", torch.bfloat16)  # panels would take precedence


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_model_on_tiles_matches_its_dense_self(tiny_model_factory, monkeypatch, tied):
    path = tiny_model_factory("llama", tie_word_embeddings=tied)
    prompts = random_prompts(500, (5, 33, 17), seed=4)
    tiles = make_runner(path, dtype="bfloat16")
    layers = [m for m in tiles.model.modules() if getattr(m, "packed_weight", None) is not None]
    assert layers and all(m.packed_weight.dim() == 5 for m in layers), "every linear and the head on tiles"
    dense = assert_bf16_close_to_dense(tiles, path, prompts, monkeypatch)
    assert_pool_conserved(tiles)
    assert_pool_conserved(dense)
