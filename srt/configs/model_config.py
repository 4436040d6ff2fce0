"""`ModelConfig`: what the runtime needs from a model directory's config.json, derived once."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from srt.environ import envs

logger = logging.getLogger(__name__)

# Checked in order; the first present one is the model's native length.
CONTEXT_LENGTH_KEYS = (
    "max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings",
)
_DTYPES = {
    "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float": torch.float32, "float32": torch.float32,
}
_KV_DTYPES = {
    "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}


def check_model_dir(path: str, what: str = "Model path") -> None:
    """A clear error for a local path that is missing or is not a model directory."""
    if not os.path.exists(path):
        raise ValueError(
            f"{what} {path!r} does not exist. --model-path must be a local Hugging Face format "
            f"directory (this runtime never downloads from a model hub)."
        )
    if not os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a file, not a model directory.")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"{what} {path!r} has no config.json: it is not a Hugging Face format model directory."
        )


def _read_json(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _rope_settings(cfg: Dict[str, Any]) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(rope_theta, rope_scaling) from classic keys or transformers 5's `rope_parameters`."""
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    return float(theta), scaling


def derive_context_length(cfg: Dict[str, Any], rope_scaling: Optional[Dict[str, Any]]) -> Tuple[int, str]:
    """The native context length and the key it came from (times the rope factor where the
    checkpoint states the pre-scaling length; llama3 and `original_max_position_embeddings`
    configs already state the scaled length)."""
    for key in CONTEXT_LENGTH_KEYS:
        if cfg.get(key) is not None:
            length, source = int(cfg[key]), key
            break
    else:
        return 2048, "default (no length key in config.json)"
    if rope_scaling and rope_scaling.get("rope_type") not in ("default", "llama3", "mrope"):
        if "original_max_position_embeddings" not in rope_scaling and "factor" in rope_scaling:
            length = int(length * float(rope_scaling["factor"]))
            source += f" x rope_scaling.factor {rope_scaling['factor']}"
    window = cfg.get("sliding_window")
    if isinstance(window, int) and cfg.get("use_sliding_window", True) and 0 < window < length:
        # Attention here is full, so beyond the window the model would see more than it was
        # trained with: cap the context instead of silently changing its behaviour.
        logger.warning("Sliding-window attention (%d) is not implemented; capping the context length "
                       "from %d to %d.", window, length, window)
        length, source = window, "sliding_window (not implemented: context capped)"
    return length, source


@dataclass
class ModelConfig:
    model_path: str
    hf_config: Dict[str, Any]
    context_len: int
    context_len_source: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    eos_token_ids: Set[int] = field(default_factory=set)
    bos_token_id: Optional[int] = None

    @classmethod
    def from_server_args(cls, args) -> "ModelConfig":
        return cls.load(args.model_path, args.dtype, args.kv_cache_dtype, args.context_length,
                        tokenizer_path=args.tokenizer_path)

    @classmethod
    def load(cls, model_path: str, dtype: str = "auto", kv_cache_dtype: str = "auto",
             context_length: Optional[int] = None, tokenizer_path: Optional[str] = None) -> "ModelConfig":
        check_model_dir(model_path)
        cfg = _read_json(os.path.join(model_path, "config.json"))
        theta, scaling = _rope_settings(cfg)
        derived, source = derive_context_length(cfg, scaling)
        tok_cfg = _read_json(os.path.join(tokenizer_path or model_path, "tokenizer_config.json"))
        tok_max = tok_cfg.get("model_max_length")
        if isinstance(tok_max, (int, float)) and 0 < tok_max < derived:
            derived, source = int(tok_max), "tokenizer_config.json model_max_length"
        context_len = cls._resolve_context_len(derived, source, context_length)
        torch_dtype = cls._resolve_dtype(cfg, dtype)
        if kv_cache_dtype == "auto":
            kv = torch_dtype
        elif kv_cache_dtype in _KV_DTYPES:
            kv = _KV_DTYPES[kv_cache_dtype]
        else:
            raise ValueError(f"Invalid --kv-cache-dtype {kv_cache_dtype!r}. Accepted values: auto, "
                             + ", ".join(_KV_DTYPES) + ".")
        gen = _read_json(os.path.join(model_path, "generation_config.json"))
        eos: Set[int] = set()
        for src in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, list):
                eos.update(int(x) for x in src)
        return cls(model_path, cfg, context_len, source, torch_dtype, kv, theta, scaling,
                   eos, cfg.get("bos_token_id"))

    @staticmethod
    def _resolve_context_len(derived: int, source: str, requested: Optional[int]) -> int:
        if requested is None:
            return derived
        if requested > derived:
            var = envs.ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.name
            if not envs.ALLOW_OVERWRITE_LONGER_CONTEXT_LEN.get():
                raise ValueError(
                    f"User-specified --context-length ({requested}) is greater than the derived context "
                    f"length ({derived}, from {source}). Lower --context-length, or set {var}=1 to allow "
                    f"it (RoPE models may produce NaN or garbage past the derived length)."
                )
            logger.warning("--context-length %d exceeds the derived %d (%s); allowed by %s.",
                           requested, derived, source, var)
        return requested

    @staticmethod
    def _resolve_dtype(cfg: Dict[str, Any], dtype: str) -> torch.dtype:
        if dtype == "auto":
            name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
            return _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
        if dtype not in _DTYPES:
            raise ValueError(f"Invalid --dtype {dtype!r}. Accepted values: auto, " + ", ".join(_DTYPES) + ".")
        return _DTYPES[dtype]

    # Shapes read by layers and pools.
    @property
    def architectures(self) -> List[str]:
        return list(self.hf_config.get("architectures") or [])

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def num_hidden_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_key_value_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def intermediate_size(self) -> int:
        return int(self.hf_config["intermediate_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def rms_norm_eps(self) -> float:
        return float(self.hf_config.get("rms_norm_eps", 1e-6))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf_config.get("tie_word_embeddings", False))
