"""Linear layers over panel-packed weights (C++ in csrc/gemm.cpp), for CPUs where oneDNN's
decode-sized matmuls are slow; srt/layers/cpu_weight_packing.py decides when they are used.

    torch.ops.srt_cpu.convert_weight_packed(weight [N, K]) -> panels [ceil(N / W), K, W]
    torch.ops.srt_cpu.weight_packed_linear(x [M, K], panels, bias | None, N, out_dtype | None) -> [M, N]
    torch.ops.srt_cpu.unpack_weight_panels(panels, start, count) -> dense fp32 [K, count * W]

W (`panel_width()`) is two vectors of floats: 16 with AVX2, 32 with AVX-512. fp32 or bf16 weights,
x and output (bf16 weights are widened in registers), fp32 accumulation, one rounding of the output.
A bf16 panel's k row holds its W columns as W / 2 pairs (column j, column j + W / 2), which the
kernel widens with a shift and a mask; `panel_columns` undoes that order.

bf16 on AMX tiles (csrc/amx_gemm.cpp), where the build and the CPU have them (`load_amx_ops()`):

    torch.ops.srt_cpu.convert_weight_amx(weight [N, K] bf16) -> tiles [N/16, K/32, 16, 16, 2]
    torch.ops.srt_cpu.amx_linear(x [M, K] bf16, tiles, bias | None, out_dtype | None) -> [M, N]

N a multiple of 16 and K of 32 (`amx_fits`); fp32 accumulation, output bf16 (default) or fp32.

fp32 over the dense weight (csrc/dense_gemm.cpp), where the build has AVX-512 (`load_dense_ops()`):

    torch.ops.srt_cpu.dense_linear(x [M, K] fp32, weight [N, K] fp32, bias | None) -> [M, N] fp32

for decode-sized M: one dot product per output, four x rows by four weight rows per tile.
"""

from __future__ import annotations

import functools

import torch

from kernels.cpu import build


@functools.lru_cache(maxsize=None)
def load_gemm_ops() -> bool:
    """Whether the panel GEMM ops are usable here (builds the library on first use)."""
    if not build.load_cpu_kernels():
        return False
    torch.library.register_fake("srt_cpu::convert_weight_packed", _convert_weight_packed_fake)
    torch.library.register_fake("srt_cpu::weight_packed_linear", _weight_packed_linear_fake)
    torch.library.register_fake("srt_cpu::unpack_weight_panels", _unpack_weight_panels_fake)
    return True


@functools.lru_cache(maxsize=None)
def load_amx_ops() -> bool:
    """Whether the AMX linear ops are usable here: the library builds, it was built for a CPU with
    AMX tiles, and Linux lets this process use them."""
    if not build.load_cpu_kernels() or not torch.ops.srt_cpu.amx_linear_available():
        return False
    torch.library.register_fake("srt_cpu::convert_weight_amx", _convert_weight_amx_fake)
    torch.library.register_fake("srt_cpu::amx_linear", _amx_linear_fake)
    return True


@functools.lru_cache(maxsize=None)
def load_dense_ops() -> bool:
    """Whether the fp32 dense-weight linear op is usable here: the library builds with AVX-512."""
    if not build.load_cpu_kernels() or not torch.ops.srt_cpu.dense_linear_available():
        return False
    torch.library.register_fake("srt_cpu::dense_linear", _dense_linear_fake)
    return True


def _dense_linear_fake(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether a [N, K] weight fits whole AMX tiles (N a multiple of 16, K of 32)."""
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0


def _convert_weight_amx_fake(weight):
    n, k = weight.shape
    return weight.new_empty(n // 16, k // 32, 16, 16, 2)


def _amx_linear_fake(x, packed, bias, out_dtype):
    return x.new_empty(x.shape[0], packed.shape[0] * 16, dtype=out_dtype or x.dtype)


@functools.lru_cache(maxsize=None)
def panel_width() -> int:
    """Output columns per panel in this build (a weight's rows are padded to a multiple of it)."""
    return int(torch.ops.srt_cpu.convert_weight_packed(torch.zeros(1, 1, device="cpu")).shape[2])


def panel_columns(panels: torch.Tensor) -> torch.Tensor:
    """`convert_weight_packed`'s panels [P, K, W] with each k row's columns in order (bf16 panels
    store them as pairs (j, j + W / 2)); fp32 panels as they are."""
    if panels.dtype != torch.bfloat16:
        return panels
    p, k, w = panels.shape
    return panels.view(p, k, w // 2, 2).transpose(2, 3).reshape(p, k, w)


def _convert_weight_packed_fake(weight):
    w = panel_width()
    return weight.new_empty((weight.shape[0] + w - 1) // w, weight.shape[1], w)


def _unpack_weight_panels_fake(packed, start, count):
    return packed.new_empty(packed.shape[1], count * packed.shape[2], dtype=torch.float32)


def _weight_packed_linear_fake(x, packed, bias, out_features, out_dtype):
    return x.new_empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
