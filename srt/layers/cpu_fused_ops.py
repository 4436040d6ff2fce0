"""When a layer runs its fused C++ CPU op (kernels/cpu/elementwise.py) instead of its torch code,
and which CPU extend attention a model runs.

`SRT_CPU_FUSED_OPS=0` keeps the torch code, as does a machine where the kernels cannot build.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from kernels.cpu.elementwise import load_fused_ops
from srt.environ import envs

DTYPES = (torch.float32, torch.bfloat16)
EXTEND_ATTENTION_CHOICES = ("auto", "op", "sdpa")


def fused_ops_for(*tensors: torch.Tensor) -> Optional[Any]:
    """`torch.ops.srt_cpu` when every tensor is a CPU fp32/bf16 tensor of one dtype and the fused
    ops are on; else None (the caller runs its torch code)."""
    if torch.compiler.is_compiling():
        # Inductor fuses these itself, and dynamo cannot trace the build check below (file and PATH
        # lookups): it broke the graph at every norm and recompiled per layer until its limit.
        return None
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype not in DTYPES:
        return None
    if any(t.device.type != "cpu" or t.dtype != first.dtype for t in tensors[1:]):
        return None
    return torch.ops.srt_cpu if _enabled() else None


@functools.lru_cache(maxsize=None)
def _enabled() -> bool:
    return envs.CPU_FUSED_OPS.get() and load_fused_ops()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles and the process may use them (torch asks the kernel)."""
    init_amx = getattr(torch._C._cpu, "_init_amx", None)
    try:
        return bool(init_amx()) if init_amx is not None else False
    except RuntimeError:
        return False


def cpu_extend_uses_op(dtype: torch.dtype) -> bool:
    """Whether CPU extend attention runs the C++ op reading the KV pool in place (kernels/cpu)
    rather than torch's SDPA over each request's gathered K/V (`SRT_CPU_EXTEND_ATTENTION`).
    `auto`: the op, except bf16 on a CPU with AMX tiles, where torch's flash SDPA multiplies on the
    tiles: SmolLM2-135M bf16 prefill ran 1.12-1.24x faster through it on the Xeon with AMX of
    README ("CPU decode runner", its extend paragraph); in fp32 the op was 1.05-1.06x faster there."""
    choice = (envs.CPU_EXTEND_ATTENTION.get() or "auto").lower()
    if choice not in EXTEND_ATTENTION_CHOICES:
        raise ValueError(f"$SRT_CPU_EXTEND_ATTENTION must be one of {', '.join(EXTEND_ATTENTION_CHOICES)}, "
                         f"got {choice!r}.")
    if choice != "auto":
        return choice == "op"
    return not (dtype == torch.bfloat16 and cpu_has_amx())
