"""The C++ panel GEMM (kernels/cpu/gemm.py) against F.linear in float64 (the oracle): every row
count around the micro-tile and row-block edges, widths that are not whole panels, depths that
are not whole chunks, fp32 and bf16 weights, inputs and outputs, with and without bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.gemm import load_amx_ops, load_dense_ops, load_gemm_ops, panel_columns, panel_width
from srt.layers.cpu_weight_packing import pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not load_gemm_ops(), reason="the C++ CPU kernels cannot build here")
ops = torch.ops.srt_cpu
F32, BF16 = torch.float32, torch.bfloat16


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def test_panels_hold_the_weight_columns_in_order_and_zeros_past_the_end():
    w = torch.arange(37 * 5, dtype=F32).view(37, 5)
    panels = ops.convert_weight_packed(w)
    width = panel_width()
    assert width in (16, 32) and panels.shape == (-(-37 // width), 5, width)
    for n in range(37):
        assert torch.equal(panels[n // width, :, n % width], w[n])
    flat = panels.permute(0, 2, 1).reshape(-1, 5)
    assert torch.count_nonzero(flat[37:]) == 0


def test_bf16_panels_hold_column_pairs():
    """A bf16 panel's k row is W / 2 pairs: word j holds column j (low half), column j + W / 2 (high)."""
    w = torch.arange(37 * 5, dtype=F32, device="cpu").view(37, 5).bfloat16()  # integers < 256: exact in bf16
    panels = ops.convert_weight_packed(w)
    width = panel_width()
    assert panels.dtype == BF16 and panels.shape == (-(-37 // width), 5, width)
    half = width // 2
    for n in range(37):
        p, j = divmod(n, width)
        slot = 2 * j if j < half else 2 * (j - half) + 1
        assert torch.equal(panels[p, :, slot], w[n])
        assert torch.equal(panel_columns(panels)[p, :, j], w[n])
    assert torch.count_nonzero(panel_columns(panels).permute(0, 2, 1).reshape(-1, 5)[37:]) == 0


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 16, 18, 19, 47, 48, 49, 97, 193, 300])
@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_equals_float64_linear(rows, w_dtype, bias):
    g = torch.Generator().manual_seed(rows)
    n, k = 3 * panel_width() + 5, 130  # a partial last panel; two whole k chunks and a tail
    w = (torch.randn(n, k, generator=g) * 0.1).to(w_dtype)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    got = ops.weight_packed_linear(x, ops.convert_weight_packed(w), b, n, None)
    assert got.shape == (rows, n) and got.dtype == F32
    # fp32 accumulation over k = 130 products: well inside 1e-5 of float64 here.
    torch.testing.assert_close(got.double(), _ref(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_bf16_output_is_the_fp32_product_rounded_once(rows):
    g = torch.Generator().manual_seed(7 + rows)
    w = (torch.randn(64, 96, generator=g) * 0.1).bfloat16()
    b = torch.randn(64, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    got = ops.weight_packed_linear(x, ops.convert_weight_packed(w), b, 64, None)
    assert got.dtype == BF16
    want = _ref(x, w, b).float()
    # One rounding of a value within 1e-5 of `want`: at most one bf16 step away from want's rounding.
    step = want.abs().clamp_min(1e-3) * 2.0 ** -7
    assert torch.all((got.float() - want).abs() <= step)
    wide = ops.weight_packed_linear(x, ops.convert_weight_packed(w), b, 64, F32)
    assert wide.dtype == F32
    torch.testing.assert_close(wide.double(), _ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_takes_batched_and_non_contiguous_inputs():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    panels = pack_weight(w, panels=True)
    x3 = torch.randn(2, 5, 24, generator=g)
    got = packed_linear(x3, panels, out_features=40)
    assert got.shape == (2, 5, 40)
    torch.testing.assert_close(got.double(), _ref(x3, w, None), rtol=1e-5, atol=1e-5)
    xt = torch.randn(24, 9, generator=g).t()  # [9, 24], column-major
    torch.testing.assert_close(packed_linear(xt, panels, out_features=40).double(), _ref(xt, w, None),
                               rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused_with_the_sizes():
    panels = ops.convert_weight_packed(torch.randn(32, 16))
    with pytest.raises(RuntimeError, match="x has 8 features, the weight 16"):
        ops.weight_packed_linear(torch.randn(2, 8), panels, None, 32, None)
    with pytest.raises(RuntimeError, match="out_features 99 does not fit"):
        ops.weight_packed_linear(torch.randn(2, 16), panels, None, 99, None)
    with pytest.raises(RuntimeError, match="bias has 3 values"):
        ops.weight_packed_linear(torch.randn(2, 16), panels, torch.zeros(3), 32, None)
    with pytest.raises(RuntimeError, match="fp32 or bf16 weights"):
        ops.convert_weight_packed(torch.randn(4, 4, dtype=torch.float64))


def test_bench_cpu_gemm_prints_both_tables(llama_model):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_cpu_gemm.py"
    out = subprocess.run([sys.executable, str(script), "--model-path", str(llama_model), "--rows", "1", "7",
                          "--reps", "1", "--rounds", "1", "--steps", "2", "--batch", "2", "--input-len", "8"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows if r[2].isdigit()] == ["| 1", "| 7"]  # one op row per row count
    layouts = [r.split(" | ")[1] for r in rows if r.startswith(("| float32", "| bfloat16"))]
    amx = ["amx"] if load_amx_ops() else []  # bf16 on AMX tiles, where the CPU has them
    dense = ["dense"] if load_dense_ops() else []  # fp32 on the dense weights, where the build has AVX-512
    assert layouts == ["onednn", "srt"] + dense + ["onednn", "srt"] + amx
    if dense:
        assert all(len(r.split(" | ")) == len(rows[0].split(" | ")) for r in rows if r[2].isdigit())


@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("slab", [None, 1], ids=["one_slab", "slabs"])
def test_prefill_sized_inputs_run_on_a_dense_copy_with_the_same_result(w_dtype, slab, monkeypatch):
    """From PANEL_DENSE_ROWS rows the panels are laid back out as dense fp32 slabs for BLAS."""
    from srt.layers import cpu_weight_packing

    if slab is not None:
        monkeypatch.setattr(cpu_weight_packing, "PANEL_DENSE_SLAB", 130 * panel_width())  # one panel a slab
    g = torch.Generator().manual_seed(11)
    n, k, rows = 3 * panel_width() + 5, 130, cpu_weight_packing.PANEL_DENSE_ROWS
    w = (torch.randn(n, k, generator=g) * 0.1).to(w_dtype)
    b = torch.randn(n, generator=g)
    x = torch.randn(rows, k, generator=g)
    panels = pack_weight(w, panels=True)
    got = packed_linear(x, panels, b, out_features=n)
    assert got.shape == (rows, n) and got.dtype == F32
    torch.testing.assert_close(got.double(), _ref(x, w, b), rtol=1e-5, atol=1e-5)
    kernel = ops.weight_packed_linear(x, panels, b, n, None)
    torch.testing.assert_close(got, kernel, rtol=1e-5, atol=1e-5)
    x16 = x.bfloat16()
    got16 = packed_linear(x16, panels, b.bfloat16(), out_features=n)
    assert got16.dtype == BF16
    torch.testing.assert_close(got16.float(), _ref(x16, w, b.bfloat16()).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["w_fp32", "w_bf16"])
def test_unpacked_panels_are_the_transposed_weight_columns(w_dtype):
    """unpack_weight_panels lays panels [start, start + count) out as dense fp32 [in, out] (bf16
    widened exactly), columns in order and zeros past the weight's last row."""
    width = panel_width()
    n, k = 9 * width + 3, 37  # 10 panels (more than one unpack block), a partial last one
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5)).to(w_dtype)
    panels = ops.convert_weight_packed(w)
    whole = ops.unpack_weight_panels(panels, 0, panels.shape[0])
    assert whole.shape == (k, 10 * width) and whole.dtype == F32
    assert torch.equal(whole[:, :n], w.float().t()) and torch.count_nonzero(whole[:, n:]) == 0
    part = ops.unpack_weight_panels(panels, 2, 3)
    assert torch.equal(part, w.float()[2 * width:5 * width].t())


@pytest.mark.parametrize("start,count", [(-1, 2), (0, 0), (9, 2)])
def test_unpacking_panels_outside_the_weight_is_refused(start, count):
    panels = ops.convert_weight_packed(torch.zeros(10 * panel_width(), 4))
    with pytest.raises(RuntimeError, match=r"unpack_weight_panels: panels \[.*outside \[0, 10\)"):
        ops.unpack_weight_panels(panels, start, count)
