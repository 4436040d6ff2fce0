"""The C++ fp32 dense-weight linear (kernels/cpu/csrc/dense_gemm.cpp) against F.linear in float64
(the oracle): row and column counts around the 4 x 4 tile's edges, depths that are not whole
vectors, with and without bias; a row's result independent of the rows beside it; the Python
dispatch (the kernel up to DENSE_KERNEL_ROWS rows, BLAS above); the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu.gemm import load_dense_ops
from srt.layers import cpu_weight_packing
from srt.layers.cpu_weight_packing import DENSE_KERNEL_ROWS, dense_linear, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not load_dense_ops(), reason="the C++ CPU kernels build without AVX-512 here")
ops = torch.ops.srt_cpu


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("rows", [0, 1, 3, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("n,k", [(1, 16), (13, 130), (64, 256), (37, 7)])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_equals_float64_linear(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g, device="cpu") * 0.1
    b = torch.randn(n, generator=g, device="cpu") if bias else None
    x = torch.randn(rows, k, generator=g, device="cpu")
    got = ops.dense_linear(x, w, b)
    assert got.shape == (rows, n) and got.dtype == torch.float32 and got.device.type == "cpu"
    torch.testing.assert_close(got.double(), _ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(45, 200, generator=g, device="cpu"), torch.randn(45, generator=g, device="cpu")
    x = torch.randn(23, 200, generator=g, device="cpu")
    full = ops.dense_linear(x, w, b)
    for i in (0, 5, 22):
        assert torch.equal(ops.dense_linear(x[i:i + 1], w, b), full[i:i + 1])
    assert torch.equal(ops.dense_linear(x[3:10], w, b), full[3:10])
    # A column block's result does not depend on the weight rows beside it either.
    assert torch.equal(ops.dense_linear(x, w[:6], b[:6]), full[:, :6])


def test_a_zero_depth_linear_is_its_bias():
    x, w, b = torch.empty(3, 0, device="cpu"), torch.empty(5, 0, device="cpu"), torch.arange(5.0, device="cpu")
    assert torch.equal(ops.dense_linear(x, w, b), b.expand(3, 5))
    assert torch.equal(ops.dense_linear(x, w, None), torch.zeros(3, 5, device="cpu"))


def test_non_contiguous_input_is_taken():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(20, 48, generator=g, device="cpu")
    x = torch.randn(48, 9, generator=g, device="cpu").t()  # [9, 48], column-major
    torch.testing.assert_close(ops.dense_linear(x, w, None).double(), _ref(x, w, None), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused_with_the_sizes_and_dtypes():
    w, x = torch.randn(8, 32, device="cpu"), torch.randn(2, 32, device="cpu")
    with pytest.raises(RuntimeError, match=r"dense_linear: x has 16 features, the weight 32"):
        ops.dense_linear(torch.randn(2, 16, device="cpu"), w, None)
    with pytest.raises(RuntimeError, match=r"dense_linear: x must be an fp32 \[M, K\], got BFloat16"):
        ops.dense_linear(x.bfloat16(), w, None)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous fp32 \[N, K\].*\(not contiguous\)"):
        ops.dense_linear(x, torch.randn(32, 8, device="cpu").t(), None)
    with pytest.raises(RuntimeError, match=r"bias must be fp32 with 8 values, got Float with 7"):
        ops.dense_linear(x, w, torch.randn(7, device="cpu"))


@pytest.mark.parametrize("rows", [1, DENSE_KERNEL_ROWS, DENSE_KERNEL_ROWS + 1, 300])
def test_dispatch_runs_the_kernel_up_to_the_limit_and_blas_above(rows, monkeypatch):
    blas = []

    def linear(*args):
        blas.append(args[0].shape[0])
        return F.linear(*args)

    monkeypatch.setattr(cpu_weight_packing, "F", SimpleNamespace(linear=linear))
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(40, 72, generator=g, device="cpu"), torch.randn(40, generator=g, device="cpu")
    x = torch.randn(rows, 72, generator=g, device="cpu")
    got = dense_linear(x, w, b)
    assert blas == ([] if rows <= DENSE_KERNEL_ROWS else [rows])
    if rows <= DENSE_KERNEL_ROWS:
        assert torch.equal(got, ops.dense_linear(x, w, b))
    torch.testing.assert_close(got.double(), _ref(x, w, b), rtol=1e-5, atol=1e-5)


def test_packed_linear_on_a_dense_weight_keeps_leading_dims_and_out_dtype():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 40, generator=g, device="cpu")
    packed = pack_weight(w, dense=True)
    assert packed.data_ptr() == w.data_ptr()  # no copy: the weight is its own packed form
    x = torch.randn(2, 3, 40, generator=g, device="cpu")
    got = packed_linear(x, packed, out_dtype=torch.bfloat16)
    assert got.shape == (2, 3, 24) and got.dtype == torch.bfloat16
    assert torch.equal(got, ops.dense_linear(x.reshape(6, 40), w, None).bfloat16().view(2, 3, 24))
