"""Sampler cost per step, the full-sort sampler it replaced ("old") beside the current one ("new").

    python scripts/bench_sampling.py [--device cuda] [--reps 50]

Old is the oracle `reference_sample` of tests/test_sampling.py (softmax of the whole vocabulary,
a full sort whenever any row uses top-k or top-p, a float64 CDF); new is `Sampler`. Both get the
same logits and `SamplingBatchInfo`, with penalties off. A second table times bringing a
penalised running batch's sampling state up to date when one request leaves and one joins:
rebuilding it from scratch (`from_params`, as decode did before) against `filter_batch` +
`merge_batch`. Prints milliseconds per call (median over --reps; min in brackets, the best guide
when other processes share the machine).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from srt.layers.sampler import Sampler, _uniforms  # noqa: E402
from srt.sampling import SamplingBatchInfo, SamplingParams  # noqa: E402
from test_sampling import reference_sample  # noqa: E402

CONFIGS = {
    "all greedy": [dict(temperature=0.0)],
    "all top-p 0.9": [dict(top_p=0.9)],
    "all top-k 40 + top-p 0.9": [dict(top_k=40, top_p=0.9)],
    "half greedy, half top-k 40 + top-p 0.9": [dict(temperature=0.0), dict(top_k=40, top_p=0.9)],
}


def timed(fn: Callable[[], object], reps: int, device: torch.device) -> Tuple[float, float]:
    """(median, min) milliseconds of `fn()`, synchronising around each call on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    times: List[float] = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def sampler_rows(device: torch.device, reps: int) -> List[List[str]]:
    sampler = Sampler()
    rows = []
    for bs in (16, 64):
        for vocab in (32000, 49152):
            logits = torch.randn(bs, vocab, device=device, generator=None) * 4
            for name, settings in CONFIGS.items():
                params = [SamplingParams(**settings[i % len(settings)]) for i in range(bs)]
                info = SamplingBatchInfo.from_params(params, vocab, device)

                def old():
                    info.apply_logits_bias(logits)
                    return reference_sample(logits, info, _uniforms(info, None))

                old_ms, old_min = timed(old, reps, device)
                new_ms, new_min = timed(lambda: sampler(logits, info), reps, device)
                rows.append([str(bs), str(vocab), name, f"{old_ms:.3f} [{old_min:.3f}]",
                             f"{new_ms:.3f} [{new_min:.3f}]", f"{old_ms / new_ms:.1f}x"])
    return rows


def membership_rows(device: torch.device, reps: int) -> List[List[str]]:
    rng = random.Random(0)
    rows = []
    for bs, generated in ((64, 512), (256, 1024)):
        vocab = 32000
        params = [SamplingParams(frequency_penalty=0.5, top_p=0.9) for _ in range(bs)]
        outputs = [[rng.randrange(vocab) for _ in range(generated)] for _ in range(bs)]

        def rebuild():
            return SamplingBatchInfo.from_params(params, vocab, device, output_ids=outputs)

        running = rebuild()
        joiner = SamplingBatchInfo.from_params(params[:1], vocab, device, output_ids=[outputs[0][:1]])

        def incremental():
            running.filter_batch(range(1, bs))
            running.merge_batch(joiner)

        old_ms, old_min = timed(rebuild, reps, device)
        new_ms, new_min = timed(incremental, reps, device)
        rows.append([str(bs), str(generated), f"{old_ms:.3f} [{old_min:.3f}]",
                     f"{new_ms:.3f} [{new_min:.3f}]", f"{old_ms / new_ms:.1f}x"])
    return rows


def print_table(header: List[str], rows: List[List[str]]) -> None:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths]] + rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    print(f"Sampler, ms per step on {device} (median [min] of {args.reps})")
    with torch.inference_mode():
        print_table(["batch", "vocab", "rows", "old: full sort", "new", "speed-up"], sampler_rows(device, args.reps))
    print(f"\nPenalised running batch, one request leaves and one joins, ms on {device}")
    print_table(["batch", "generated/req", "rebuild", "filter + merge", "speed-up"],
                membership_rows(device, max(3, args.reps // 5)))


if __name__ == "__main__":
    main()
