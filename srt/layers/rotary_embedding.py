"""Rotary position embedding (neox/rotate-half style) with default, linear and llama3 scaling.

The cos/sin tables depend only on the RoPE configuration, so `get_rope` hands every layer (and
every model) with the same configuration one shared module: one table in memory, counted once.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from srt.layers.cpu_fused_ops import fused_ops_for

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
    of HF's per-call computation.

    The tables are non-persistent buffers: outside `state_dict` (nothing to load), but in
    `buffers()`, so `module_nbytes` counts them, and once, since all layers share the module.
    They are read-only after construction; moving or casting a model that shares them (`.to`)
    would move them for every model that shares them too.
    """

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
        ops = fused_ops_for(q, k, self.cos_cache)
        if ops is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            return ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache)
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k


# One RoPE module per configuration, held weakly: an entry lives exactly as long as some model
# holds its module, so the cache never grows past the models alive and there is nothing to reset.
_ROPE_CACHE: "weakref.WeakValueDictionary[tuple, RotaryEmbedding]" = weakref.WeakValueDictionary()


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: Optional[Dict[str, Any]],
             dtype: torch.dtype) -> RotaryEmbedding:
    """The shared `RotaryEmbedding` for this configuration on the current default device (the one
    `get_model` builds under). The rotary dimension is `head_dim` (no partial rotary here)."""
    device = torch.empty(0).device
    scaling = json.dumps(rope_scaling, sort_keys=True, default=repr)
    key = (head_dim, max_position, float(base), scaling, dtype, device)
    rope = _ROPE_CACHE.get(key)
    if rope is None:
        rope = RotaryEmbedding(head_dim, max_position, base, rope_scaling, dtype)
        _ROPE_CACHE[key] = rope
    return rope
