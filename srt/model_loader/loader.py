"""Build a model from a `ModelConfig` and fill its weights (safetensors or seeded dummy)."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from srt.configs.model_config import ModelConfig
from srt.layers.cpu_weight_packing import cpu_has_fast_bf16
from srt.model_loader.weight_utils import list_safetensors_files, safetensors_weights_iterator
from srt.models.registry import resolve_model_cls

logger = logging.getLogger(__name__)


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _dummy_init(model: nn.Module, seed: int) -> None:
    """Seeded small random weights; norms start at 1 so activations stay in range."""
    gens = {}
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
            continue
        if p.device not in gens:
            gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        p.data.uniform_(-0.05, 0.05, generator=gens[p.device])


def get_model(config: ModelConfig, load_format: str = "auto", device: str = "cpu", seed: int = 0) -> nn.Module:
    model_cls = resolve_model_cls(config.architectures)
    with default_dtype(config.dtype), torch.device(device):
        model = model_cls(config)
    if load_format == "dummy":
        _dummy_init(model, seed)
    else:
        files = list_safetensors_files(config.model_path)
        loaded = model.load_weights(safetensors_weights_iterator(files))
        expected = {n for n, _ in model.named_parameters()}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(
                f"Checkpoint in {config.model_path!r} lacks {len(missing)} weight(s) the model needs, "
                f"e.g. {', '.join(missing[:5])}."
            )
    model.eval()
    logger.info("Loaded %s (%s, %.1fM parameters) on %s.", type(model).__name__, config.dtype,
                sum(p.numel() for p in model.parameters()) / 1e6, device)
    return model


def warn_slow_cpu_bf16(dtype: torch.dtype, device: str, fast_weights: bool = False) -> bool:
    """Warn when bf16 linears will run on torch's slow path: a CPU without bf16 matrix instructions
    whose weights were neither panel-packed nor widened to fp32 (srt/layers/cpu_weight_packing.py)."""
    if dtype != torch.bfloat16 or not str(device).startswith("cpu") or fast_weights or cpu_has_fast_bf16():
        return False
    logger.warning("bfloat16 on a CPU without bf16 matrix instructions (no AVX512-BF16 / AMX) and without panel-packed "
                   "or widened weights (SRT_CPU_GEMM=onednn with SRT_CPU_WIDEN_BF16=0, SRT_CPU_WEIGHT_PACKING=0 or "
                   "--enable-torch-compile): matmuls "
                   "take a slow path, 5-15x slower than float32 here. Use --dtype float32 for speed.")
    return True
