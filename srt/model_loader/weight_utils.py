"""Reading safetensors checkpoints (single file or sharded with an index) and mapping names."""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, List, Sequence, Tuple

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from srt.layers.linear import default_weight_loader


def list_safetensors_files(model_path: str) -> List[str]:
    """Shards named by `model.safetensors.index.json`, else every `*.safetensors` file."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_path, f))]
        if missing:
            raise ValueError(f"{index} names shard(s) that are missing: {', '.join(missing)}.")
        return [os.path.join(model_path, f) for f in files]
    files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(
            f"No *.safetensors weights found in {model_path!r}. Only safetensors checkpoints are supported "
            f"(or use --load-format dummy for random weights)."
        )
    return [os.path.join(model_path, f) for f in files]


def safetensors_weights_iterator(files: Sequence[str], show_progress: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not show_progress):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_stacked_weights(model: nn.Module, weights: Iterable[Tuple[str, torch.Tensor]],
                         stacked_params_mapping: Sequence[Tuple[str, str, object]]) -> set:
    """Load HF-named tensors, routing separate projections into merged parameters."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for name, tensor in weights:
        for ours, theirs, shard in stacked_params_mapping:
            if theirs in name:
                target = name.replace(theirs, ours)
                if target in params:
                    params[target].weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
        else:
            if name not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}.")
            loader = getattr(params[name], "weight_loader", default_weight_loader)
            loader(params[name], tensor)
            loaded.add(name)
    return loaded
