"""When a layer runs its fused C++ CPU op (kernels/cpu/elementwise.py) instead of its torch code.

`SRT_CPU_FUSED_OPS=0` keeps the torch code, as does a machine where the kernels cannot build.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from kernels.cpu.elementwise import load_fused_ops
from srt.environ import envs

DTYPES = (torch.float32, torch.bfloat16)


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
