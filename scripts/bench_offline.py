"""Offline throughput through `Engine` vs HF transformers `generate` in static batches.

    python scripts/bench_offline.py                 # ~100M Llama, both mixes
    python scripts/bench_offline.py --num-prompts 64 --mix random

Both sides run the same weights (a ~90M-parameter Llama folder written once by
`scripts/make_tiny_model.py` into .tiny_models/) on the same token ids, greedy, with
`ignore_eos` so every request produces exactly --output-len tokens. Mixes:
  shared-prefix  groups of prompts that share a long system prompt, each with its own question
  random         independent prompts of random length
HF runs left-padded static batches of --hf-batch-size; the engine gets every prompt at once.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHAPE = dict(layers=12, hidden=768, heads=12, kv_heads=4, intermediate=2048, vocab=8192, context=4096)


def build_prompts(mix: str, n: int, vocab: int, args) -> list:
    rng = random.Random(0)
    tok = lambda k: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    if mix == "shared-prefix":
        systems = [tok(args.system_len) for _ in range(args.groups)]
        return [systems[i % args.groups] + tok(args.question_len) for i in range(n)]
    return [tok(rng.randint(args.random_min, args.random_max)) for _ in range(n)]


def run_engine(engine, prompts, out_len: int) -> float:
    engine.flush_cache()
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": out_len, "temperature": 0,
                                                               "ignore_eos": True})
    dt = time.perf_counter() - t
    assert all(o["meta_info"]["completion_tokens"] == out_len for o in outs)
    return dt


@torch.no_grad()
def run_hf(model, prompts, out_len: int, batch: int) -> float:
    t = time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                             do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + out_len
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", choices=["shared-prefix", "random", "both"], default="both")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--random-min", type=int, default=32)
    p.add_argument("--random-max", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--no-hf", action="store_true")
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    from srt.entrypoints.engine import Engine
    from tiny_models import get_tiny_model

    path = get_tiny_model("llama", dtype=args.dtype, **SHAPE)
    engine = Engine(model_path=str(path), dtype=args.dtype, device="cpu", max_total_tokens=200_000,
                    log_level="warning")
    hf = None if args.no_hf else AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    mixes = ["shared-prefix", "random"] if args.mix == "both" else [args.mix]
    print(f"# bench_offline: ~90M Llama ({args.dtype}), {args.num_prompts} prompts, output {args.output_len} "
          f"tokens, HF static batches of {args.hf_batch_size}, threads={torch.get_num_threads()}")
    print("| mix | input tokens | engine s | engine out tok/s | HF s | HF out tok/s | speed-up |")
    print("|---|---|---|---|---|---|---|")
    try:
        for mix in mixes:
            prompts = build_prompts(mix, args.num_prompts, SHAPE["vocab"], args)
            run_engine(engine, prompts[:4], 2)  # warm-up
            t_eng = run_engine(engine, prompts, args.output_len)
            gen = args.num_prompts * args.output_len
            row = f"| {mix} | {sum(map(len, prompts))} | {t_eng:.1f} | {gen / t_eng:.1f} |"
            if hf is not None:
                t_hf = run_hf(hf, prompts, args.output_len, args.hf_batch_size)
                row += f" {t_hf:.1f} | {gen / t_hf:.1f} | {t_hf / t_eng:.2f}x |"
            else:
                row += " - | - | - |"
            print(row, flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
