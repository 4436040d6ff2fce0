"""Attention backends; `create_attention_backend` picks one by name (flashinfer is lazy)."""

from __future__ import annotations

import importlib.util

ATTENTION_BACKENDS = ("auto", "torch_native", "flashinfer")


def flashinfer_available() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def resolve_attention_backend(name: str, device: str, dtype=None) -> str:
    """Map `auto` to a concrete backend: flashinfer on CUDA when installed (and the model dtype
    is one its kernels take: fp16/bf16), else torch_native."""
    import torch

    half = dtype in (None, torch.float16, torch.bfloat16)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"Invalid --attention-backend {name!r}. Choose one of: {', '.join(ATTENTION_BACKENDS)}."
        )
    if name == "auto":
        use = device.startswith("cuda") and half and flashinfer_available()
        return "flashinfer" if use else "torch_native"
    if name == "flashinfer":
        if not device.startswith("cuda"):
            raise ValueError("--attention-backend flashinfer needs --device cuda.")
        if not flashinfer_available():
            raise ValueError(
                "--attention-backend flashinfer needs the flashinfer-python package "
                "(pip install '.[gpu]'), or use --attention-backend torch_native."
            )
    return name


def create_attention_backend(name: str, model_runner, extend_op: bool = True) -> "AttentionBackend":  # noqa: F821
    """The backend `name` for this runner's pools; torch_native on CPU runs extend through the C++
    op only with `extend_op` (else torch's SDPA over gathered K/V)."""
    if name == "flashinfer":
        from kernels.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(model_runner)
    from kernels.attention.torch_native_backend import TorchNativeAttnBackend

    pool = model_runner.token_to_kv_pool
    return TorchNativeAttnBackend(model_runner.device, q_dtype=pool.dtype, kv_dtype=pool.store_dtype,
                                  extend_op=extend_op)
