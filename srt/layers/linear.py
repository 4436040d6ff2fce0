"""Linear layers whose parameters carry their own weight loaders.

Tensor-parallel size is 1 for now; the names follow SGLang so sharding can arrive later
without renaming. Merged layers map HF's separate projections onto one matmul.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        # torch.empty: weights come from the checkpoint (or dummy init), so no init cost here.
        self.weight = nn.Parameter(torch.empty(output_size, input_size))
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class RowParallelLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    pass


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input stacked on the output dim (gate_up_proj)."""

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        start = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(nn.Parameter(param.data.narrow(0, start, size), requires_grad=False), loaded)


class QKVParallelLinear(LinearBase):
    """q, k and v projections in one matmul; output split is [H*D, KVH*D, KVH*D]."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Union[str, None] = None) -> None:
        if shard_id is None:
            return default_weight_loader(param, loaded)
        offsets = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                   "v": (self.q_size + self.kv_size, self.kv_size)}
        start, size = offsets[shard_id]
        default_weight_loader(nn.Parameter(param.data.narrow(0, start, size), requires_grad=False), loaded)
