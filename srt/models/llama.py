"""Llama 2/3/3.1 and Mistral (same architecture) over the paged KV pool."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Optional, Tuple

import torch
from torch import nn

from srt.layers.activation import SiluAndMul
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import get_rope
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.model_loader.weight_utils import load_stacked_weights

if TYPE_CHECKING:
    from srt.configs.model_config import ModelConfig
    from srt.model_executor.forward_batch_info import ForwardBatch


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    qkv_bias = False

    def __init__(self, config: "ModelConfig", layer_id: int):
        super().__init__()
        hf = config.hf_config
        self.head_dim = config.head_dim
        bias = self.qkv_bias or bool(hf.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias)
        # This rank's heads (all of them at tp = 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=bool(hf.get("attention_bias", False)))
        self.rotary_emb = get_rope(self.head_dim, config.context_len, config.rope_theta,
                                   config.rope_scaling, config.dtype)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id)

    def project_qk(self, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Hook before RoPE (Qwen3 normalizes q and k per head here)."""
        return q, k

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.project_qk(q, k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(-1, self.q_size), k, v, fb)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: "ModelConfig", layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bias=bool(config.hf_config.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: "ForwardBatch",
                residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config: "ModelConfig"):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch") -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, fb, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # (our parameter, HF checkpoint name, shard id)
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, config: "ModelConfig"):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: "ForwardBatch") -> LogitsProcessorOutput:
        hidden = self.model(input_ids, positions, fb)
        return self.logits_processor(hidden, self.lm_head, fb)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> set:
        """Copy checkpoint tensors into parameters; returns the names of parameters loaded."""
        skip = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
        tied = self.config.tie_word_embeddings
        filtered = ((n, w) for n, w in weights
                    if not n.endswith(skip) and not (tied and n == "lm_head.weight"))
        return load_stacked_weights(self, filtered, self.stacked_params_mapping)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral shares Llama's layers; sliding-window configs are capped in ModelConfig."""


EntryClass = [LlamaForCausalLM, MistralForCausalLM]
