"""Linear layers whose parameters carry their own weight loaders (SGLang's names and sharding).

With tensor parallelism each rank holds a slice: column-parallel layers split the output dim
(no communication; the next row-parallel layer consumes the slice), row-parallel layers split the
input dim and all-reduce their output. Each parameter's `weight_loader` takes the full checkpoint
tensor and copies this rank's slice, so checkpoints load unchanged at any `--tp-size`.
"""

from __future__ import annotations

from typing import List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from srt.distributed.parallel_state import divide, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from srt.layers.cpu_weight_packing import packed_linear


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _copy_slice(dst: torch.Tensor, loaded: torch.Tensor, dim: int, start: int, size: int) -> None:
    """Copy `loaded.narrow(dim, start, size)` into `dst` (shapes checked)."""
    part = loaded.narrow(dim, start, size)
    if dst.shape != part.shape:
        raise ValueError(f"weight slice {tuple(part.shape)} does not match parameter {tuple(dst.shape)}")
    dst.copy_(part)


class LinearBase(nn.Module):
    """`output_size` x `input_size` as held on this rank."""

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
        # Packed weight on CPU (oneDNN's layout or panels), set after loading (srt/layers/cpu_weight_packing.py).
        self.register_buffer("packed_weight", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias, out_features=self.packed_out_features)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output dim split over the TP ranks; rank r holds rows `[r * out/tp, (r + 1) * out/tp)`."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(input_size, divide(output_size, self.tp_size, "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_slice(param.data, loaded, 0, self.tp_rank * size, size)


class RowParallelLinear(LinearBase):
    """Input dim split over the TP ranks; the partial products are summed by an all-reduce, and
    the bias (held whole on every rank) is added once, after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        super().__init__(divide(input_size, self.tp_size, "input size"), output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            return default_weight_loader(param, loaded)
        size = param.shape[1]
        _copy_slice(param.data, loaded, 1, self.tp_rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tensor_model_parallel_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked on the output dim (gate_up_proj); each is
    split over the ranks, so rank r holds its slice of every projection, stacked."""

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = [divide(s, self.tp_size, "projection size") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if shard_id is None:
            if self.tp_size == 1:
                return default_weight_loader(param, loaded)
            raise ValueError("a merged checkpoint tensor cannot be split by shard under tensor parallelism")
        start = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        _copy_slice(param.data.narrow(0, start, size), loaded, 0, self.tp_rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; this rank's output is [H/tp*D, kv*D, kv*D].

    q heads split evenly. KV heads split evenly when tp <= num_kv_heads; when tp is larger,
    each KV head is replicated on tp / num_kv_heads ranks (rank r holds head r // replicas).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        if tp >= num_kv_heads:
            self.num_kv_heads, self.kv_replicas = 1, divide(tp, num_kv_heads, "a replicated num_key_value_heads")
        else:
            self.num_kv_heads, self.kv_replicas = divide(num_kv_heads, tp, "num_key_value_heads"), 1
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.tp_rank, self.tp_size = get_tp_rank(), tp
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Union[str, None] = None) -> None:
        if shard_id is None:
            if self.tp_size == 1:
                return default_weight_loader(param, loaded)
            raise ValueError("a fused qkv checkpoint tensor cannot be split under tensor parallelism")
        if shard_id == "q":
            dst, start = param.data.narrow(0, 0, self.q_size), self.tp_rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            dst = param.data.narrow(0, offset, self.kv_size)
            start = (self.tp_rank // self.kv_replicas) * self.kv_size
        _copy_slice(dst, loaded, 0, start, dst.shape[0])
