"""SiLU-and-mul over a merged gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.cpu_fused_ops import fused_ops_for


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops_for(x)
        if ops is not None and x.dim() == 2 and x.stride(-1) == 1:
            return ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
