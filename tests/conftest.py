"""Session-wide test set-up: offline Hugging Face, importable repo packages, tiny model fixtures.

Tiny models are built once per parameter set and cached on disk (see tests/tiny_models.py);
tests marked `gpu` are skipped on machines without CUDA.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

# Before anything imports transformers or huggingface_hub: they read these once.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (str(_TESTS_DIR.parent), str(_TESTS_DIR)):  # `import srt` and `import tiny_models`
    if _path not in sys.path:
        sys.path.insert(0, _path)

from tiny_models import get_tiny_model  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `@pytest.mark.gpu` tests when CUDA is unavailable (torch imported only if any exist)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory() -> Callable[..., Path]:
    """`get_tiny_model(arch, **params) -> Path`, for tests that need non-default shapes."""
    return get_tiny_model


@pytest.fixture(scope="session")
def llama_model() -> Path:
    return get_tiny_model("llama")


@pytest.fixture(scope="session")
def qwen2_model() -> Path:
    return get_tiny_model("qwen2")


@pytest.fixture(scope="session")
def qwen3_model() -> Path:
    return get_tiny_model("qwen3")


@pytest.fixture(scope="session")
def mistral_model() -> Path:
    return get_tiny_model("mistral")
