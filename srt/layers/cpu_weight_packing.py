"""CPU linear layers over oneDNN-packed weights (SGLang packs CPU weights after loading, too).

A torch `F.linear` on the CPU hands the row-major weight to BLAS on every call, which re-lays it
out for its kernel each time; at decode sizes (a few to a few hundred rows) that costs more than
the arithmetic, and an fp32 decode step read its weights at a third of the memory bandwidth.
After loading, each linear weight is reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing uses) and every call
goes through `torch.ops.mkldnn._linear_pointwise`. The dense copy is then freed: the packed one
is the weight. Measured on SmolLM2-135M's 120 decode matmuls at 16 rows (2 threads): fp32 3.4x,
bf16 1.8x faster (README, "Packed CPU weights").

bf16 on a CPU without bf16 matrix instructions (no AVX512-BF16 / AMX, e.g. AVX2-only): oneDNN has no
bf16 matmul kernels there and torch's fallback is 5-15x slower than fp32, so each bf16 weight is
widened to fp32 once and packed ("widened" packing): the activations, the KV cache and every other
op stay bf16, each linear takes its input to fp32 and rounds its output back, the same numbers an
fp32-accumulating bf16 matmul gives. The weights then take fp32 bytes (counted, and
`SRT_CPU_WIDEN_BF16=0` keeps bf16 weights on the slow path).

Panel packing (`SRT_CPU_GEMM`, default `auto`): on a CPU without AVX-512 (AVX2-only), oneDNN's
matmuls at decode sizes use about half the arithmetic and read the weights at a third of the
memory bandwidth, so there the weights are packed into column panels for our own kernel
(kernels/cpu/gemm.py: every weight byte streamed once per call, in address order). Measured on
the AVX2 EPYC, SmolLM2-135M's 120 layer matmuls at 16 rows: 29.6 ms against oneDNN's 43.3 ms.
bf16 weights stay bf16 in the panels (widened in registers: half the bytes of the fp32 copy).
`srt` forces the panels, `onednn` keeps oneDNN; on CPUs with AVX-512, `auto` keeps fp32 weights
dense (below) and packs bf16 ones into AMX tiles where the CPU has them, else oneDNN's layout.

Dense fp32 (`SRT_CPU_GEMM=auto` or `dense`, fp32, a CPU and build with AVX-512): the weights stay
as loaded, row-major [out, in], and are not packed at all. Inputs of up to DENSE_KERNEL_ROWS rows
(decode) run kernels/cpu/gemm.py's dot kernel, larger ones BLAS. oneDNN's packed fp32 matmuls of a
few rows spend most of their time outside the arithmetic: on the Xeon with AMX of README ("Dense
fp32 linears"), llama-26m's 64 layer matmuls at 16 rows took 2.4 ms on the dot kernel against 4.0
through oneDNN (SmolLM2-135M's 120: 33 against 37 ms), while at prefill sizes BLAS on the dense
weight ran within a few percent of oneDNN either way. One copy of each weight serves both, and an
LM head tied to the embedding uses the embedding's own rows instead of a packed copy of them.

AMX tiles (`SRT_CPU_GEMM=auto` or `amx`, bf16, a CPU with AMX): bf16 weights are packed into
kernels/cpu/gemm.py's AMX tiles instead, for our own tile kernel. oneDNN's AMX matmul costs tens of
microseconds a call whatever the size, which at decode sizes is most of the call: on the Xeon with
AMX of README ("AMX linears"), llama-26m's four layer matmuls at 16 rows took 15.4 us a call on the
tiles against 36.2 through oneDNN. At prefill sizes it ran at 0.74-1.41x oneDNN's speed (slowest
at 64-256 rows and in 4,096-row prefills), with no JIT for row counts it has not seen. A weight
whose shape does not fit whole tiles keeps oneDNN's layout.

Off on CUDA, for other dtypes, where torch has no oneDNN (and the panel kernels do not build),
under `--enable-torch-compile` (inductor cannot trace an opaque oneDNN tensor: the compiled decode
freezes the dense weights and inductor packs its own copy per graph, `frozen_weight_nbytes`) and
with `SRT_CPU_WEIGHT_PACKING=0`.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu.gemm import amx_fits, load_amx_ops, load_dense_ops, load_gemm_ops, panel_width
from srt.environ import envs

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
GEMM_CHOICES = ("auto", "srt", "onednn", "amx", "dense")
# Dense fp32 weights: inputs of up to this many rows run the dot kernel, larger ones BLAS. At 64 rows
# the two were even on llama-26m's layer matmuls and the kernel 1.2x on SmolLM2's; the LM head of
# 49,152 rows ran 1.5x faster on the kernel at 16 rows and 1.14x at 64.
DENSE_KERNEL_ROWS = 64
# Panels, prefill-sized inputs: from this many rows the weight is laid back out as dense fp32
# [in, out] for the call (a copy of its bytes) and BLAS runs it; below it the copy costs more than
# it saves. The panel kernel re-reads the weights for every 96-row block. At 512 when it ran
# matmuls of a few hundred rows at 75-95% of oneDNN's speed (a SmolLM2 prefill of 512 tokens: 1373
# ms on the panels, 1227 through the copy). After the bf16 pair layout and the prefetch template
# (Zen 3, every layer's matmuls, panels / copy + BLAS in turns, fp32 and bf16 weights), the copy
# lost at 512 rows (SmolLM2 1.08x / 1.04x, llama-26m 1.24x / 1.19x) and at 1,024 (SmolLM2 1.05x /
# 1.04x, llama-26m 1.09x / 1.00x; an earlier run 1.08x / 1.01x, 1.13x / 0.95x), and tied at 1,536
# and 2,048 (0.96-1.04x). Whole SmolLM2 prefills, both ways in turns on one runner: 4 x 256, 2 x 512
# and 1 x 1,024 tokens 0.98-1.04x (fp32) and 0.95-1.05x (bf16) on the panels, a tie. So the panels
# take every chunk of the CPU's default prefill chunk (1,024) and skip the copy's allocation.
PANEL_DENSE_ROWS = 2048
# ... in slabs of at most this many fp32 values, so the copy stays small for any model.
PANEL_DENSE_SLAB = 1 << 24
# oneDNN picks its blocking for this many rows; any row count runs on the packed weight.
BATCH_SIZE_HINT = 16


def packing_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether linear weights of this dtype on this device can be packed here."""
    return (str(device).startswith("cpu") and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and _packs_on_this_cpu(dtype))


@functools.lru_cache(maxsize=None)
def _packs_on_this_cpu(dtype: torch.dtype) -> bool:
    """oneDNN's bf16 packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and raises without them
    (an AVX2-only CPU): one small weight packed and used tells, and the model then keeps its dense
    weights."""
    try:
        packed = pack_weight(torch.ones(8, 8, dtype=dtype))
        out = packed_linear(torch.ones(2, 8, dtype=dtype), packed)
        ok = bool(torch.all(out == 8))
    except RuntimeError as exc:
        logger.info("Not packing %s CPU weights: oneDNN cannot on this CPU (%s).", dtype, str(exc).splitlines()[0])
        return False
    if not ok:
        logger.warning("Not packing %s CPU weights: a packed test weight gave wrong results on this CPU.", dtype)
    return ok


def cpu_has_fast_bf16() -> bool:
    """Whether oneDNN has bf16 matmul kernels here (AVX512-BF16 or AMX); without them torch runs
    bf16 linears on a slow path (5-15x fp32 on an AVX2-only CPU)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(probe()) if probe is not None else True
    except RuntimeError:
        return True


def cpu_gemm_choice() -> str:
    """`SRT_CPU_GEMM`, checked."""
    choice = (envs.CPU_GEMM.get() or "auto").lower()
    if choice not in GEMM_CHOICES:
        raise ValueError(f"$SRT_CPU_GEMM must be one of {', '.join(GEMM_CHOICES)}, got {choice!r}.")
    return choice


def cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512")


def uses_amx_gemm(device: str, dtype: torch.dtype) -> bool:
    """Whether bf16 linear weights are packed into AMX tiles for kernels/cpu/gemm.py's tile kernel
    here: `SRT_CPU_GEMM` `auto` or `amx` on a CPU (and build) with AMX tiles."""
    return (str(device).startswith("cpu") and dtype == torch.bfloat16
            and cpu_gemm_choice() in ("auto", "amx", "dense") and load_amx_ops())


def uses_dense_gemm(device: str, dtype: torch.dtype) -> bool:
    """Whether fp32 linear weights stay dense for kernels/cpu/gemm.py's dot kernel (and BLAS) here:
    `SRT_CPU_GEMM` `auto` or `dense` where the C++ kernels build with AVX-512."""
    return (str(device).startswith("cpu") and dtype == torch.float32 and cpu_gemm_choice() in ("auto", "dense")
            and cpu_has_avx512() and load_dense_ops())


def uses_panel_gemm(device: str, dtype: torch.dtype) -> bool:
    """Whether linear weights of this dtype are packed into panels for kernels/cpu/gemm.py here:
    `SRT_CPU_GEMM=srt`, or `auto` on a CPU without AVX-512 (where they were measured faster than
    oneDNN), when the C++ kernels build."""
    if not (str(device).startswith("cpu") and dtype in PACKABLE_DTYPES):
        return False
    choice = cpu_gemm_choice()
    if choice in ("onednn", "amx") or (choice in ("auto", "dense") and cpu_has_avx512()):
        return False
    return load_gemm_ops()


def widens_bf16(device: str, dtype: torch.dtype) -> bool:
    """Whether bf16 weights are packed as fp32 here (no bf16 matmul kernels on this CPU, and the
    oneDNN layout in use: panels keep bf16 weights)."""
    return (dtype == torch.bfloat16 and str(device).startswith("cpu") and envs.CPU_WIDEN_BF16.get()
            and not cpu_has_fast_bf16() and not uses_panel_gemm(device, dtype)
            and packing_supported(device, torch.float32))


def pack_weight(weight: torch.Tensor, widen: bool = False, panels: bool = False, amx: bool = False,
                dense: bool = False) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout (an opaque mkldnn tensor); with
    `widen`, as fp32; with `panels`, into kernels/cpu/gemm.py's column panels (same dtype); with
    `amx`, into its AMX tiles where the shape fits them (`amx_fits`), else oneDNN's layout; with
    `dense` (fp32), the weight itself, contiguous."""
    weight = weight.detach().contiguous()
    if dense:
        return weight
    if panels:
        return torch.ops.srt_cpu.convert_weight_packed(weight)
    if amx and amx_fits(weight):
        return torch.ops.srt_cpu.convert_weight_amx(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.float() if widen else weight, BATCH_SIZE_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  out_dtype: Optional[torch.dtype] = None, out_features: Optional[int] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the packed weight; x is [..., in]. A widened (fp32) weight
    takes x and bias to fp32; the output is in `out_dtype` (default x's dtype). Panels need
    `out_features` (the weight's rows) when that is not a whole number of panels."""
    out_dtype = out_dtype or x.dtype
    if packed.dim() == 5:  # AMX tiles
        x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch.ops.srt_cpu.amx_linear(x2, packed, bias, out_dtype)
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed.dim() == 2 and not packed.is_mkldnn:  # dense fp32
        x2 = x.reshape(-1, x.shape[-1])
        out = dense_linear(x2, packed, bias)
        out = out.view(*x.shape[:-1], packed.shape[0])
        return out if out.dtype == out_dtype else out.to(out_dtype)
    if not packed.is_mkldnn:
        n = out_features or packed.shape[0] * packed.shape[2]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] >= PANEL_DENSE_ROWS:
            out = _panels_dense_linear(x2, packed, bias, n, out_dtype)
        else:
            out = torch.ops.srt_cpu.weight_packed_linear(x2, packed, bias, n, out_dtype)
        return out.view(*x.shape[:-1], n)
    if x.shape[0] == 0:  # oneDNN refuses an empty problem
        return x.new_empty(*x.shape[:-1], packed.shape[0], dtype=out_dtype)
    if packed.dtype != x.dtype:
        x = x.to(packed.dtype)
        bias = None if bias is None else bias.to(packed.dtype)
    out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return out if out.dtype == out_dtype else out.to(out_dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, in] @ a dense fp32 weight [out, in]: the dot kernel up to DENSE_KERNEL_ROWS rows, BLAS
    above."""
    if x.dtype != torch.float32:
        x = x.float()
    if x.shape[0] <= DENSE_KERNEL_ROWS:
        return torch.ops.srt_cpu.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _panels_dense_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor], n: int,
                         out_dtype: torch.dtype) -> torch.Tensor:
    """x [M, in] @ panels as BLAS matmuls over dense fp32 copies of column slabs of the weight."""
    p, k, w = packed.shape
    xf = x.float()
    slab = max(1, PANEL_DENSE_SLAB // (k * w))  # panels per slab
    outs = []
    for start in range(0, p, slab):
        count = min(slab, p - start)
        dense = torch.ops.srt_cpu.unpack_weight_panels(packed, start, count)  # [in, count * w] fp32
        cols = min(n, (start + count) * w) - start * w
        dense = dense[:, :cols]
        if bias is None:
            outs.append(torch.mm(xf, dense))
        else:
            outs.append(torch.addmm(bias[start * w:start * w + cols].float(), xf, dense))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    return out if out.dtype == out_dtype else out.to(out_dtype)


def set_packed_weight(module: nn.Module, packed: torch.Tensor, free_dense: bool) -> None:
    """Attach `packed` as the module's non-persistent `packed_weight` buffer (outside state_dict,
    counted by `module_nbytes`) and its row count as `packed_out_features`; with `free_dense` the
    dense weight becomes an empty tensor."""
    module.register_buffer("packed_weight", packed, persistent=False)
    module.packed_out_features = module.weight.shape[0]
    if free_dense:
        shape = module.weight.shape
        module.weight = nn.Parameter(module.weight.new_empty((0, shape[1])), requires_grad=False)


def will_pack(device: str, dtype: torch.dtype, enable_torch_compile: bool) -> bool:
    """Whether `pack_model_weights` packs a model of this dtype on this device."""
    return (envs.CPU_WEIGHT_PACKING.get() and not enable_torch_compile
            and (uses_dense_gemm(device, dtype) or uses_panel_gemm(device, dtype) or widens_bf16(device, dtype)
                 or packing_supported(device, dtype)))


def _tied_head(model: nn.Module) -> Optional[nn.Module]:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return lm_head if lm_head is not None and lm_head is embed else None


def _packable(model: nn.Module, dtype: torch.dtype) -> list:
    """The modules `pack_model_weights` packs: every linear layer of `dtype`, then the LM head."""
    # Linear layers declare the (empty) `packed_weight` slot; the LM head does not.
    found = [m for m in model.modules()
             if "packed_weight" in m._buffers and m.weight.dtype == dtype and m.weight.dim() == 2]
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and getattr(lm_head, "weight", None) is not None and lm_head.weight.dtype == dtype:
        found.append(lm_head)
    return found


def frozen_graph_count(torch_compile_max_bs: int) -> int:
    """Decode graphs `--enable-torch-compile` builds on CPU: batch 1 (a size dynamo specialises)
    and one for every larger batch (`compile_warmup.py`)."""
    return 2 if torch_compile_max_bs >= 2 else 1


def frozen_weight_nbytes(model: nn.Module, device: str, dtype: torch.dtype, torch_compile_max_bs: int) -> int:
    """Bytes the compiled CPU decode adds: inductor freezes the weights and packs its own copy of
    every linear weight and the LM head in each graph, beside the dense ones eager prefill uses."""
    if device != "cpu":
        return 0
    dense = sum(m.weight.numel() * m.weight.element_size() for m in _packable(model, dtype))
    return dense * frozen_graph_count(torch_compile_max_bs)


def packing_extra_nbytes(model: nn.Module, device: str, dtype: torch.dtype, enable_torch_compile: bool,
                         torch_compile_max_bs: int = 32) -> int:
    """Bytes packing adds to the model (a meta-device one will do): the packed copy of an LM head
    tied to the input embedding, with widened bf16 the fp32 half of every packed weight, and with
    panels the zero rows that pad each weight to whole panels. Every other packed weight replaces
    its dense copy. Under --enable-torch-compile, inductor's frozen copies instead."""
    if enable_torch_compile:
        return frozen_weight_nbytes(model, device, dtype, torch_compile_max_bs)
    if not will_pack(device, dtype, enable_torch_compile) or uses_dense_gemm(device, dtype):
        return 0  # dense: every weight is its own loaded tensor, a tied head the embedding's
    panels = uses_panel_gemm(device, dtype)
    packed_size = (torch.float32 if widens_bf16(device, dtype) else dtype).itemsize
    extra = 0
    head = _tied_head(model)
    for module in _packable(model, dtype):
        (rows, cols), size = module.weight.shape, module.weight.element_size()
        if panels:
            rows = -(-rows // panel_width()) * panel_width()
        packed = rows * cols * packed_size
        extra += packed if module is head else packed - module.weight.numel() * size
    return extra


def pack_model_weights(model: nn.Module, device: str, dtype: torch.dtype, enable_torch_compile: bool,
                       torch_compile_max_bs: int = 32) -> int:
    """Pack every linear layer of a loaded model and its LM head; returns how many were packed.

    The LM head is packed too; when it is tied to the input embedding, the embedding keeps its
    dense rows (it is a lookup table) and the head gets a packed copy."""
    if not will_pack(device, dtype, enable_torch_compile):
        if enable_torch_compile and will_pack(device, dtype, False):
            logger.warning("--enable-torch-compile leaves the CPU linear weights dense for eager prefill (inductor "
                           "cannot trace our packed layouts); the compiled decode freezes them and inductor packs "
                           "its own copy in each of its %d graphs (+%.2f GiB). On the Xeon with AMX of README "
                           "(torch.compile decode on CPU), SmolLM2-135M bf16 at batch 16 x 288 decoded in 30.9 ms "
                           "compiled against 35.9 ms eager packed, while its prefill ran on dense weights. Measure "
                           "both with scripts/bench_one_batch.py before keeping the flag.",
                           frozen_graph_count(torch_compile_max_bs),
                           frozen_weight_nbytes(model, device, dtype, torch_compile_max_bs) / 2**30)
        return 0
    widen, panels, head = widens_bf16(device, dtype), uses_panel_gemm(device, dtype), _tied_head(model)
    amx = not panels and uses_amx_gemm(device, dtype)
    dense = uses_dense_gemm(device, dtype)
    modules = _packable(model, dtype)
    for module in modules:
        packed = pack_weight(module.weight, widen, panels, amx, dense)
        set_packed_weight(module, packed, free_dense=module is not head)
    tiles = sum(module.packed_weight.dim() == 5 for module in modules)
    if tiles:
        logger.info("Packed %d CPU linear weights into AMX tiles for the C++ tile kernel (kernels/cpu/gemm.py; "
                    "SRT_CPU_GEMM=onednn keeps oneDNN's layout)%s.", tiles,
                    f", {len(modules) - tiles} into oneDNN's (shapes that are not whole tiles)"
                    if tiles < len(modules) else "")
    elif dense:
        logger.info("Kept %d fp32 CPU linear weights dense: up to %d rows run the C++ dot kernel, more BLAS "
                    "(kernels/cpu/gemm.py; SRT_CPU_GEMM=onednn packs them into oneDNN's layout).", len(modules),
                    DENSE_KERNEL_ROWS)
    elif panels:
        logger.info("Packed %d CPU linear weights into %d-column panels for the C++ panel GEMM (kernels/cpu/gemm.py; "
                    "SRT_CPU_GEMM=onednn keeps oneDNN's layout).", len(modules), panel_width())
    elif widen:
        logger.info("Packed %d CPU linear weights into oneDNN's blocked layout, widened to fp32: this CPU has no "
                    "bf16 matrix instructions (AVX512-BF16 / AMX), so bf16 matmuls run in fp32 and the weights "
                    "take fp32 bytes (SRT_CPU_WIDEN_BF16=0 keeps them bf16 on a 5-15x slower path).", len(modules))
    else:
        logger.info("Packed %d CPU linear weights into oneDNN's blocked layout (SRT_CPU_WEIGHT_PACKING=0 turns "
                    "this off).", len(modules))
    return len(modules)
