"""Qwen3: Llama layers with per-head RMSNorm on q and k before RoPE (and an explicit head_dim)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Tuple

import torch

from srt.layers.layernorm import RMSNorm
from srt.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

if TYPE_CHECKING:
    from srt.configs.model_config import ModelConfig


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: "ModelConfig", layer_id: int):
        super().__init__(config, layer_id)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_qk(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model


EntryClass = [Qwen3ForCausalLM]
