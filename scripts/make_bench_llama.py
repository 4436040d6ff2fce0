"""Build the benchmark model `llama-26m`: a ~25M-parameter Llama with SmolLM2's real tokenizer, fp32.

Nothing is downloaded beyond what scripts/make_real_model.py already fetches: the tokenizer files
(tokenizer.json, tokenizer_config.json, chat_template.jinja) are copied byte for byte from the
SmolLM2-135M-Instruct folder, which is built first. The weights are transformers' own seeded
initialisation (torch.manual_seed(0); LlamaForCausalLM(config), fp32), so the model writes
gibberish but costs what a trained model of its shape costs: LlamaForCausalLM, vocab 49,152 (SmolLM2's
ids for bos / eos / pad), hidden 256, 16 layers, 4 heads of 64 / 2 KV heads, MLP 768, tied
embeddings, context 8,192, SmolLM2's rope_theta and rms_norm_eps; ~25.2M parameters, ~96 MiB.

    python scripts/make_bench_llama.py                # build into the cache if missing, print the path
    python scripts/make_bench_llama.py --out DIR      # build into DIR (empty or absent)

The cache is `<repo>/.tiny_models/llama-26m-<hash>/` (git-ignored), where the hash covers this
file, the SmolLM2 folder it copied from (whose name carries make_real_model.py's own hash) and the
library versions (torch's RNG and transformers' init decide the weights). A build goes to a
temporary sibling and is renamed into place, like make_real_model.get_real_model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))
import make_real_model as mrm  # noqa: E402  (scripts/ is not a package)

CACHE_DIR = mrm.CACHE_DIR
MODEL_NAME = "llama-26m"
SEED = 0
SHAPE = {"hidden_size": 256, "num_hidden_layers": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 768, "max_position_embeddings": 8192, "tie_word_embeddings": True}
# Taken from SmolLM2's config.json so the copied tokenizer's ids mean the same things.
FROM_SMOLLM2 = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "rms_norm_eps", "hidden_act")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PARAM_RANGE = (24_000_000, 28_000_000)


def _rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 100000.0)))


def build_bench_llama(out: Path, smollm2: Path) -> Path:
    """Write the llama-26m folder into `out` (empty or absent), tokenizer copied from `smollm2`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty; choose a new --out")
    missing = [name for name in REQUIRED_FILES if not (smollm2 / name).is_file()]
    if missing:
        raise mrm.RealModelError(f"{smollm2} lacks {', '.join(missing)}; rebuild it (make_real_model.py)")
    out.mkdir(parents=True, exist_ok=True)
    src = json.loads((smollm2 / "config.json").read_text(encoding="utf-8"))
    theta = _rope_theta(src)
    config = LlamaConfig(**SHAPE, **{key: src[key] for key in FROM_SMOLLM2},
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    n_params = model.num_parameters()  # the tied lm_head counted once
    if not PARAM_RANGE[0] <= n_params <= PARAM_RANGE[1]:
        raise mrm.RealModelError(f"{n_params:,} parameters, outside {PARAM_RANGE}: SHAPE is wrong")
    model.save_pretrained(str(out))  # safetensors; the tied lm_head.weight is not written twice

    data = json.loads((out / "config.json").read_text(encoding="utf-8"))
    data.update(rope_theta=theta, torch_dtype="float32", dtype="float32", _num_parameters=n_params,
                _source=f"transformers' seeded init (torch.manual_seed({SEED})), tokenizer of {smollm2.name}")
    mrm._write_json(out / "config.json", data)  # classic rope_theta for plain JSON readers, like SmolLM2's
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copyfile(smollm2 / name, out / name)
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def count_parameters(folder: Path) -> int:
    """Parameters stored in `folder`'s safetensors files (tied weights stored, and counted, once)."""
    from safetensors import safe_open

    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def cache_key(smollm2: Path) -> str:
    """A short hash of what changes the files: this builder, the SmolLM2 folder, library versions."""
    import safetensors
    import tokenizers
    import torch
    import transformers

    payload = json.dumps({"builder": mrm._sha256(Path(__file__)), "tokenizer_from": smollm2.name,
                          "torch": torch.__version__, "transformers": transformers.__version__,
                          "tokenizers": tokenizers.__version__, "safetensors": safetensors.__version__},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def get_bench_llama(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the cached llama-26m folder, building SmolLM2 and then it first if missing (idempotent)."""
    smollm2 = mrm.get_real_model(cache_dir)
    final = cache_dir / f"{MODEL_NAME}-{cache_key(smollm2)}"
    return mrm.build_into_cache(final, MODEL_NAME, lambda out: build_bench_llama(out, smollm2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="Build into this folder instead of the cache.")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"Cache root (default {CACHE_DIR}).")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        if args.out is not None:
            path = build_bench_llama(args.out, mrm.get_real_model(args.cache_dir))
        else:
            path = get_bench_llama(args.cache_dir)
    except mrm.RealModelError as exc:
        sys.exit(f"make_bench_llama: {exc}")
    size = sum(f.stat().st_size for f in path.iterdir()) / 2**20
    print(f"llama-26m ({count_parameters(path):,} parameters, fp32, {size:.0f} MiB) at {path} "
          f"[{time.perf_counter() - start:.1f}s]")
    print(path)


if __name__ == "__main__":
    main()
