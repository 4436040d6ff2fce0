"""Model classes registered by their Hugging Face architecture name."""

from __future__ import annotations

import importlib
from typing import Dict, List, Type

from torch import nn

_MODULES = ("srt.models.llama", "srt.models.qwen2", "srt.models.qwen3")


def _registry() -> Dict[str, Type[nn.Module]]:
    out: Dict[str, Type[nn.Module]] = {}
    for name in _MODULES:
        for cls in importlib.import_module(name).EntryClass:
            out[cls.__name__] = cls
    return out


def supported_architectures() -> List[str]:
    return sorted(_registry())


def resolve_model_cls(architectures: List[str]) -> Type[nn.Module]:
    registry = _registry()
    for arch in architectures:
        if arch in registry:
            return registry[arch]
    raise ValueError(
        f"Model architectures {architectures} are not supported. "
        f"Supported architectures: {', '.join(sorted(registry))}."
    )
