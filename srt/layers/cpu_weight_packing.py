"""CPU linear layers over oneDNN-packed weights (SGLang packs CPU weights after loading, too).

A torch `F.linear` on the CPU hands the row-major weight to BLAS on every call, which re-lays it
out for its kernel each time; at decode sizes (a few to a few hundred rows) that costs more than
the arithmetic, and an fp32 decode step read its weights at a third of the memory bandwidth.
After loading, each linear weight is reordered once into oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing uses) and every call
goes through `torch.ops.mkldnn._linear_pointwise`. The dense copy is then freed: the packed one
is the weight. Measured on SmolLM2-135M's 120 decode matmuls at 16 rows (2 threads): fp32 3.4x,
bf16 1.8x faster (README, "Packed CPU weights").

Off on CUDA, for other dtypes, where torch has no oneDNN, under `--enable-torch-compile` (inductor
cannot trace an opaque oneDNN tensor; the compiled graph keeps the dense weights) and with
`SRT_CPU_WEIGHT_PACKING=0`.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from srt.environ import envs

logger = logging.getLogger(__name__)

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
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


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] reordered into oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), BATCH_SIZE_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` over the packed weight; x is [..., in]."""
    if x.shape[0] == 0:  # oneDNN refuses an empty problem
        return x.new_empty(*x.shape[:-1], packed.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def packed_nbytes(packed: torch.Tensor) -> int:
    """Bytes a packed weight holds (its logical size; oneDNN's blocking pads at most a block)."""
    return packed.numel() * packed.element_size()


def set_packed_weight(module: nn.Module, packed: torch.Tensor, free_dense: bool) -> None:
    """Attach `packed` as the module's non-persistent `packed_weight` buffer (outside state_dict,
    counted by `module_nbytes`); with `free_dense` the dense weight becomes an empty tensor."""
    module.register_buffer("packed_weight", packed, persistent=False)
    if free_dense:
        shape = module.weight.shape
        module.weight = nn.Parameter(module.weight.new_empty((0, shape[1])), requires_grad=False)


def will_pack(device: str, dtype: torch.dtype, enable_torch_compile: bool) -> bool:
    """Whether `pack_model_weights` packs a model of this dtype on this device."""
    return envs.CPU_WEIGHT_PACKING.get() and not enable_torch_compile and packing_supported(device, dtype)


def _tied_head(model: nn.Module) -> Optional[nn.Module]:
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return lm_head if lm_head is not None and lm_head is embed else None


def packing_extra_nbytes(model: nn.Module, device: str, dtype: torch.dtype, enable_torch_compile: bool) -> int:
    """Bytes packing adds to the model (a meta-device one will do): the packed copy of an LM head
    tied to the input embedding. Every other packed weight replaces its dense copy."""
    head = _tied_head(model)
    if head is None or head.weight.dtype != dtype or not will_pack(device, dtype, enable_torch_compile):
        return 0
    return head.weight.numel() * head.weight.element_size()


def pack_model_weights(model: nn.Module, device: str, dtype: torch.dtype, enable_torch_compile: bool) -> int:
    """Pack every linear layer of a loaded model and its LM head; returns how many were packed.

    The LM head is packed too; when it is tied to the input embedding, the embedding keeps its
    dense rows (it is a lookup table) and the head gets a packed copy."""
    if not will_pack(device, dtype, enable_torch_compile):
        return 0
    count = 0
    for module in model.modules():
        # Linear layers declare the (empty) `packed_weight` slot; the LM head does not.
        if "packed_weight" in module._buffers and module.weight.dtype == dtype and module.weight.dim() == 2:
            set_packed_weight(module, pack_weight(module.weight), free_dense=True)
            count += 1
    lm_head = getattr(model, "lm_head", None)
    if lm_head is not None and getattr(lm_head, "weight", None) is not None and lm_head.weight.dtype == dtype:
        set_packed_weight(lm_head, pack_weight(lm_head.weight), free_dense=_tied_head(model) is None)
        count += 1
    logger.info("Packed %d CPU linear weights into oneDNN's blocked layout (SRT_CPU_WEIGHT_PACKING=0 turns "
                "this off).", count)
    return count
