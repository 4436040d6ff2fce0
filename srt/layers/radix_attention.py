"""The attention layer models call; the step's backend (in `ForwardBatch`) does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        k = k.reshape(-1, self.tp_k_head_num, self.head_dim)
        v = v.reshape(-1, self.tp_v_head_num, self.head_dim)
        return fb.attn_backend.forward(q, k, v, self, fb)
