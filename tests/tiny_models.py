"""On-disk cache of tiny HF models built by scripts/make_tiny_model.py, shared by all tests.

A model is built once per distinct set of parameters (and builder source and library versions)
into `<repo>/.tiny_models/<arch>-<hash>/`. It is built in a temporary sibling folder and renamed
into place, so a parallel or aborted run never leaves a half-written model where others look.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
BUILDER_PATH = REPO_ROOT / "scripts" / "make_tiny_model.py"
CACHE_DIR = REPO_ROOT / ".tiny_models"
STALE_TMP_SECONDS = 3600


def load_script(path: Path) -> ModuleType:
    """Import a script by path, once, under its file's stem; scripts/ is not a package and stays
    off sys.path."""
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"cannot import {path}"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def load_builder() -> ModuleType:
    """Import scripts/make_tiny_model.py by path."""
    return load_script(BUILDER_PATH)


def cache_key(arch: str, params: dict[str, object]) -> str:
    """A short hash of everything that changes the files: arguments, builder code, library versions."""
    import tokenizers
    import transformers

    payload = json.dumps(
        {
            "arch": arch,
            "params": params,
            "builder": hashlib.sha256(BUILDER_PATH.read_bytes()).hexdigest(),
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _remove_stale_tmp(tmp_root: Path) -> None:
    """Drop build folders left by runs that died mid-build long ago (live builds are recent)."""
    if not tmp_root.is_dir():
        return
    for entry in tmp_root.iterdir():
        if time.time() - entry.stat().st_mtime > STALE_TMP_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)


def get_tiny_model(arch: str, **params: object) -> Path:
    """Path of a ready tiny model for `arch` with these builder parameters, building it if needed."""
    builder = load_builder()
    builder.make_params(arch, **params)  # reject bad names and values before hashing them
    final = CACHE_DIR / f"{arch}-{cache_key(arch, params)}"
    if (final / "config.json").is_file():
        return final
    tmp_root = CACHE_DIR / ".tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(tmp_root)
    work = Path(tempfile.mkdtemp(prefix=f"{final.name}-", dir=tmp_root))
    try:
        builder.build_tiny_model(arch, work / "model", **params)
        try:
            (work / "model").rename(final)
        except OSError:
            # Another process finished the same model first; its copy is identical, keep it.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------- the real model
REAL_BUILDER_PATH = REPO_ROOT / "scripts" / "make_real_model.py"
# Set to 1 to skip the real-model tier on purpose (a machine without PyPI); unset, a build that
# fails makes the tier fail, so a broken download never passes as "skipped".
SKIP_REAL_MODEL_ENV = "SRT_SKIP_REAL_MODEL"


def skip_real_model() -> bool:
    """True when $SRT_SKIP_REAL_MODEL asks to skip the real-model tier (1 / true / yes / on)."""
    return os.environ.get(SKIP_REAL_MODEL_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load_real_builder() -> ModuleType:
    """Import scripts/make_real_model.py by path."""
    return load_script(REAL_BUILDER_PATH)


def get_real_model() -> Path:
    """Path of the cached fp32 SmolLM2-135M-Instruct folder, downloading and building it if needed
    (~1.5 minutes and ~600 MB the first time); raises the builder's RealModelError if it cannot."""
    return load_real_builder().get_real_model(CACHE_DIR)
