"""Rotary position embedding (neox/rotate-half style) with default, linear and llama3 scaling."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    # Same op order as HF so fp32 cos/sin are bit-identical.
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin cache `[max_position, head_dim]`; `forward` rotates q and k in place
    of HF's per-call computation."""

    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: Optional[Dict[str, Any]] = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported. Supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        self.head_dim = head_dim
        inv_freq = _inv_freq(head_dim, base)
        positions = torch.arange(max_position, dtype=torch.int64).float()
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            positions = positions / float(rope_scaling["factor"])
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cache", emb.sin().to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """q: `[n, H, D]`, k: `[n, KVH, D]`, positions: `[n]`."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: Optional[Dict[str, Any]],
             dtype: torch.dtype) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling, dtype)
