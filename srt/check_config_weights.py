"""Weight sizes without loading a tensor: checkpoint bytes from safetensors headers, and the bytes the
loaded model will hold (the model built on the meta device, counted as `module_nbytes` counts)."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from typing import List, Optional

import torch

from srt.configs.model_config import ModelConfig
from srt.layers.cpu_weight_packing import packing_extra_nbytes
from srt.model_executor.memory_sizing import module_nbytes
from srt.model_loader.loader import default_dtype
from srt.model_loader.weight_utils import list_safetensors_files
from srt.models.registry import resolve_model_cls

# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER_BYTES = 100 * 1000 * 1000


@dataclass(frozen=True)
class CheckpointSize:
    """What the safetensors headers say: tensor bytes on disk, tensor count, files and dtypes."""

    nbytes: int
    num_tensors: int
    files: List[str]
    dtypes: List[str]


def read_safetensors_header(path: str) -> dict:
    """The JSON header of a safetensors file: 8-byte little-endian length, then the JSON (no tensor read)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is not a safetensors file: shorter than its 8-byte header length.")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER_BYTES, os.path.getsize(path) - 8):
            raise ValueError(f"{path} is not a safetensors file: header length {length} is impossible.")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({exc}).") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object.")
    return header


def checkpoint_size(model_path: str) -> CheckpointSize:
    """Sum of the tensors' byte ranges over the checkpoint's files (as the loader lists them)."""
    files = list_safetensors_files(model_path)
    nbytes, count, dtypes = 0, 0, set()
    for path in files:
        for name, entry in read_safetensors_header(path).items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            nbytes, count = nbytes + end - start, count + 1
            dtypes.add(str(entry["dtype"]))
    return CheckpointSize(nbytes, count, [os.path.basename(f) for f in files], sorted(dtypes))


def loaded_model_nbytes(config: ModelConfig, context_len: Optional[int] = None, device: str = "cpu",
                        enable_torch_compile: bool = False, torch_compile_max_bs: int = 32) -> int:
    """Bytes of parameters and buffers (rotary cos/sin included, tied weights once) of the model
    `get_model` would build, built on the meta device, plus what CPU weight packing adds on `device`
    (a tied LM head's packed copy; under --enable-torch-compile inductor's frozen copies);
    `context_len` overrides the config's."""
    if context_len is not None and context_len != config.context_len:
        config = dataclasses.replace(config, context_len=context_len)
    model_cls = resolve_model_cls(config.architectures)
    with default_dtype(config.dtype), torch.device("meta"):
        model = model_cls(config)
    return module_nbytes(model) + packing_extra_nbytes(model, device, config.dtype, enable_torch_compile,
                                                       torch_compile_max_bs)
