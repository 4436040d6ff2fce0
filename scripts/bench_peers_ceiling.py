"""The fastest any server could run a bench_peers.py run's workloads on this machine, and so the
largest ours / peer ratio a target can ask for.

A workload's output rate is bounded by its arithmetic. Every prompt token the prefix cache did not
serve passes through every linear layer and attends to the positions before it; every output token
but the first (which the prefill's logits give) does the same as a decode step; every output token
takes one row of the LM head. Counted as matmul FLOPs (2 per multiply-add), per request, from the
token counts our server reported in the run (prompt, cached, output). At the machine's FMA peak (an
FMA loop on every thread, compiled here with the C++ compiler the CPU kernels use) and at its best
dense GEMM rate (torch.mm 2048^3), that arithmetic alone takes T seconds, so no server writes more
than output / T tok/s. Against a peer's measured rate, that ceiling is the most ours / peer can be.
Memory traffic, softmax, norms, sampling and scheduling are not counted: real limits are lower.

    python scripts/bench_peers.py --model smollm2 --servers ours llama.cpp --llama-server BIN \\
        --workloads random multi-turn --repeats 2 --output runs.jsonl --log-dir logs
    python scripts/bench_peers_ceiling.py --model smollm2 --results runs.jsonl --log-dir logs
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
sys.path.insert(0, str(SCRIPTS))

logger = logging.getLogger("bench_peers_ceiling")

# The targets: ours / peer output tok/s.
TARGETS = {"llama.cpp": {"random": 1.5}, "transformers": {}}
DEFAULT_TARGET = 3.0


def target(peer: str, workload: str) -> float:
    return TARGETS.get(peer, {}).get(workload, DEFAULT_TARGET)


# ---------------------------------------------------------------------------------------- arithmetic
@dataclass(frozen=True)
class ModelShape:
    """What the FLOP count needs of a Llama-style decoder (config.json names)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        heads = config["num_attention_heads"]
        return cls(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                   intermediate=config["intermediate_size"], vocab=config["vocab_size"])

    @property
    def linear_flops(self) -> int:
        """One token through every layer's q, k, v, o, gate, up and down projections."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.layers * (h * q + 2 * h * kv + q * h + 3 * h * self.intermediate)

    def attention_flops(self, start: int, end: int) -> int:
        """Tokens at positions [start, end), each scoring and summing the values of the positions up
        to its own (i + 1 keys at position i), in every layer and query head."""
        keys = (end * (end + 1) - start * (start + 1)) // 2  # sum of (i + 1) over the range
        return 4 * self.layers * self.heads * self.head_dim * keys

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.vocab * self.hidden


def request_flops(shape: ModelShape, prompt: int, cached: int, output: int) -> Tuple[int, int]:
    """(prefill, decode) FLOPs of one request: the prompt's uncached tokens and one LM head row for
    the first output token, then a decode step for each later output token (the last one is
    sampled, never fed back)."""
    new = prompt - cached
    prefill = new * shape.linear_flops + shape.attention_flops(cached, prompt) + (shape.lm_head_flops if output else 0)
    steps = max(output - 1, 0)
    decode = steps * (shape.linear_flops + shape.lm_head_flops) + shape.attention_flops(prompt, prompt + steps)
    return prefill, decode


def run_flops(shape: ModelShape, records: Iterable[dict]) -> Tuple[int, int, int, int]:
    """(prefill FLOPs, decode FLOPs, uncached prompt tokens, output tokens) over a run's successful
    requests (bench_serving's per-request records)."""
    prefill = decode = new = out = 0
    for r in records:
        if not r.get("success"):
            continue
        p, d = request_flops(shape, r["prompt_tokens"], r.get("cached_tokens") or 0, r["output_tokens"])
        prefill, decode = prefill + p, decode + d
        new += r["prompt_tokens"] - (r.get("cached_tokens") or 0)
        out += r["output_tokens"]
    return prefill, decode, new, out


# ---------------------------------------------------------------------------------------- the machine
_FMA_SOURCE = r"""
#include <omp.h>
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64)));
#else
typedef float vec __attribute__((vector_size(32)));
#endif
// GFLOP/s of `iters` rounds of 12 independent vector FMAs (no loads) on `threads` threads.
extern "C" double fma_gflops(long iters, int threads) {
  double start = omp_get_wtime();
  float sink = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vec acc[12], mul, add;
    for (int j = 0; j < (int)(sizeof(vec) / sizeof(float)); ++j) { mul[j] = 1.0000001f; add[j] = 1e-9f; }
    for (int i = 0; i < 12; ++i) acc[i] = mul * (float)i;
    for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = acc[i] * mul + add;
    }
    for (int i = 1; i < 12; ++i) acc[0] += acc[i];
    sink += acc[0][0];
  }
  double seconds = omp_get_wtime() - start;
  volatile float keep = sink;
  (void)keep;
  return 2.0 * (sizeof(vec) / sizeof(float)) * 12.0 * (double)iters * threads / seconds / 1e9;
}
"""


def fma_peak_gflops(threads: int, iters: int = 50_000_000, repeats: int = 5) -> Optional[float]:
    """The best of `repeats` FMA-loop runs on `threads` threads, or None without a C++ compiler."""
    from kernels.cpu.build import compiler

    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "fma.cpp", Path(tmp) / "fma.so"
        src.write_text(_FMA_SOURCE)
        cmd = [compiler(), "-O2", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC",
               str(src), "-o", str(lib)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            logger.warning("FMA peak not measured (%s failed: %s)", cmd[0], getattr(exc, "stderr", exc))
            return None
        fn = ctypes.CDLL(str(lib)).fma_gflops
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_long, ctypes.c_int]
        return max(fn(iters, threads) for _ in range(repeats))


def gemm_gflops(n: int = 2048, repeats: int = 10) -> float:
    """torch.mm of two fp32 n x n matrices, the best of `repeats`."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


# ---------------------------------------------------------------------------------------- a run's files
def load_rates(results: Path) -> Dict[Tuple[str, str, str], List[float]]:
    """(workload, dtype, server) -> output tok/s of each round, from bench_peers.py --output."""
    rates: Dict[Tuple[str, str, str], List[float]] = {}
    for line in results.read_text().splitlines():
        row = json.loads(line)
        if row.get("summary"):
            rates.setdefault((row["workload"], row["dtype"], row["server"]), []).append(
                row["summary"]["output_throughput"])
    return rates


def our_records(log_dir: Path, workload: str, dtype: str) -> List[dict]:
    """Our server's per-request records of its first run of (workload, dtype) in bench_peers.py's
    --log-dir (every round sends the same prompts)."""
    files = sorted(log_dir.glob(f"ours-{dtype}-{workload}*.requests.jsonl"))
    if not files:
        raise FileNotFoundError(f"no ours-{dtype}-{workload}*.requests.jsonl in {log_dir}")
    return [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------- the table
HEADER = ["workload", "dtype", "new prompt tokens", "out tokens", "TFLOP prefill + decode", "ceiling tok/s at peak",
          "at GEMM rate", "ours tok/s (of ceiling)", "peer", "peer tok/s", "ceiling / peer", "measured ours / peer",
          "target", "target needs"]


def ceiling_rows(shape: ModelShape, rates: Dict[Tuple[str, str, str], List[float]], log_dir: Path,
                 peak: float, gemm: float) -> List[List[str]]:
    """One row per (workload, dtype, peer) of the run; `peak` and `gemm` in GFLOP/s."""
    rows = []
    for workload, dtype, server in rates:
        if server == "ours" or (workload, dtype, "ours") not in rates:
            continue
        prefill, decode, new, out = run_flops(shape, our_records(log_dir, workload, dtype))
        if not out:
            raise ValueError(f"ours wrote no tokens in {workload} / {dtype} ({log_dir}): no ceiling to compare")
        ceiling = out / ((prefill + decode) / (peak * 1e9))
        ours_rounds, peer_rounds = rates[(workload, dtype, "ours")], rates[(workload, dtype, server)]
        ours, peer = statistics.median(ours_rounds), statistics.median(peer_rounds)
        # Measured: the median of the per-round ratios when the rounds pair up (bench_peers.py's table).
        measured = (statistics.median(o / q for o, q in zip(ours_rounds, peer_rounds))
                    if len(ours_rounds) == len(peer_rounds) else ours / peer)
        goal = target(server, workload)
        rows.append([workload, dtype, f"{new:,}", f"{out:,}", f"{prefill / 1e12:.3f} + {decode / 1e12:.3f}",
                     f"{ceiling:.1f}", f"{ceiling * gemm / peak:.1f}", f"{ours:.1f} ({ours / ceiling:.0%})", server,
                     f"{peer:.1f}", f"{ceiling / peer:.2f}x", f"{measured:.2f}x", f"{goal:g}x",
                     f"{goal * peer / ceiling:.0%} of the peak"])
    return rows


def format_table(rows: List[List[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="As bench_peers.py's --model: smollm2, llama-26m or a folder.")
    p.add_argument("--results", type=Path, required=True, help="bench_peers.py --output (JSON lines).")
    p.add_argument("--log-dir", type=Path, required=True, help="bench_peers.py --log-dir of the same run.")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="Threads for the peak and GEMM.")
    p.add_argument("--peak-gflops", type=float, default=None, help="Skip the FMA loop; use this peak.")
    p.add_argument("--gemm-gflops", type=float, default=None, help="Skip torch.mm; use this GEMM rate.")
    opts = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    import bench_peers  # scripts/ is not a package; bench_peers resolves the model names

    shape = ModelShape.from_config(json.loads((bench_peers.resolve_model(opts.model) / "config.json").read_text()))
    torch.set_num_threads(opts.threads)
    gemm = opts.gemm_gflops or gemm_gflops()
    peak = opts.peak_gflops or fma_peak_gflops(opts.threads)
    if peak is None:
        p.error("no C++ compiler for the FMA loop: give --peak-gflops")
    logger.info("%s; %d threads: FMA peak %.1f GFLOP/s, torch.mm 2048^3 %.1f GFLOP/s (%.0f%% of the peak)",
                shape, opts.threads, peak, gemm, 100 * gemm / peak)
    logger.info("%s", format_table(ceiling_rows(shape, load_rates(opts.results), opts.log_dir, peak, gemm)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
