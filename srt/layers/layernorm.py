"""RMSNorm with an optional fused residual add (the residual stream is kept un-normalized)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from srt.layers.cpu_fused_ops import fused_ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        ops = fused_ops_for(x, self.weight) if residual is None else fused_ops_for(x, residual, self.weight)
        if ops is not None and x.is_contiguous() and (residual is None or residual.is_contiguous()):
            shape = x.shape
            out, res = ops.rms_norm(x.reshape(-1, shape[-1]), None if residual is None else
                                    residual.reshape(-1, shape[-1]), self.weight, self.variance_epsilon)
            return out.view(shape) if residual is None else (out.view(shape), res.view(shape))
        if residual is not None:
            x = x + residual
            residual = x
        # Normalize in fp32 and scale in the input dtype, as HF does, so bf16 matches it bit-wise.
        orig = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * xf.to(orig)
        return out if residual is None else (out, residual)
