"""Prefill and decode throughput of one static batch, side by side with HF transformers.

    python scripts/bench_one_batch.py --preset llama-100m
    python scripts/bench_one_batch.py --model-path DIR --batch-sizes 1 8 --input-lens 128

Both runtimes get the same weights (HF's seeded random init, copied into ours for presets)
and the same inputs; the table prints tokens/s and our/HF ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatch  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    "llama-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=32000),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def write_preset(name: str, out: Path, context: int) -> Path:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=context,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **PRESETS[name])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def bench_ours(runner: ModelRunner, prompts, out_len: int):
    dev = runner.device
    batch = StaticBatch(runner, len(prompts))
    out, t_prefill = timed(lambda: batch.extend(prompts), dev)
    nxt = out.next_token_logits.argmax(-1)
    steps = []
    for _ in range(out_len - 1):
        out, t = timed(lambda: batch.decode(nxt), dev)
        nxt = out.next_token_logits.argmax(-1)
        steps.append(t)
    batch.release()
    return t_prefill, statistics.median(steps)


@torch.no_grad()
def bench_hf(hf, prompts, out_len: int, device: str):
    ids = torch.tensor(prompts, device=device)
    _, t_prefill = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), device)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    _, t_gen = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), **kw), device)
    per_step = max(t_gen - t_prefill, 1e-9) / (out_len - 1)
    return t_prefill, per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-100m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-lens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tmp = tempfile.TemporaryDirectory()
    max_len = max(args.input_lens) + args.output_len + 8
    if args.model_path:
        path, load_format = args.model_path, "auto"
    else:
        path, load_format = str(write_preset(args.preset, Path(tmp.name), max(4096, max_len))), "dummy"
    sa = ServerArgs(model_path=path, dtype=args.dtype, device=args.device, load_format=load_format)
    T = max(args.batch_sizes) * max_len + 64
    runner = ModelRunner(sa, max_total_tokens=T, max_running_requests=max(args.batch_sizes))
    hf = None
    if not args.no_hf:
        torch.manual_seed(0)
        if args.model_path:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
            runner.model.load_weights(hf.state_dict().items())  # same weights on both sides
        hf = hf.to(runner.device).eval()
    vocab = runner.model_config.vocab_size
    name = args.model_path or args.preset
    print(f"# bench_one_batch: {name}, {args.dtype}, {runner.device}, threads={torch.get_num_threads()}, "
          f"output_len={args.output_len}, attention={runner.attention_backend_name}")
    head = "| batch | input | prefill tok/s | decode tok/s | decode step ms |"
    if hf is not None:
        head += " HF prefill tok/s | HF decode tok/s | prefill x | decode x |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, vocab, (bs, L), generator=g).tolist()
            bench_ours(runner, prompts[:1], 3)  # warm-up
            t_pre, t_step = bench_ours(runner, prompts, args.output_len)
            row = f"| {bs} | {L} | {bs * L / t_pre:,.0f} | {bs / t_step:,.1f} | {t_step * 1e3:.2f} |"
            if hf is not None:
                bench_hf(hf, prompts[:1], 3, runner.device)  # warm-up
                h_pre, h_step = bench_hf(hf, prompts, args.output_len, runner.device)
                row += (f" {bs * L / h_pre:,.0f} | {bs / h_step:,.1f} | {h_pre / t_pre:.2f} | "
                        f"{h_step / t_step:.2f} |")
            print(row, flush=True)


if __name__ == "__main__":
    main()
