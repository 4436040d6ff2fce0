"""bench_peers.py's table: rows of ratios against ours (medians over --repeats rounds), Markdown,
and what each server keeps its KV cache in. Imported by bench_peers.py (scripts/ is not a package)."""

from __future__ import annotations

import argparse
import shlex
import statistics
from typing import Any, Dict, List, Optional, Tuple

Key = Tuple[str, str, str]  # (workload, dtype, server)


def ratio(ours: Optional[float], peer: Optional[float]) -> str:
    """ours / peer as "1.23x"; "-" when either side is missing or the peer's value is zero."""
    if ours is None or peer is None or peer == 0:
        return "-"
    return f"{ours / peer:.2f}x"


def _median(values: List[float]) -> float:
    return statistics.median(values) if values else float("nan")


def build_rows(results: Dict[Key, Any]) -> List[List[str]]:
    """One row per (workload, dtype, server) in `results` order, peers compared with ours. A value
    is one run's summary (None: failed) or the list of its rounds' (`--repeats`): then tok/s is
    the median with the range, TTFT the median, and a peer's ratios the medians of the per-round
    ratios against ours (each round runs both servers back to back, so its ratio shares the
    machine's state of that moment)."""
    rows = []
    for (workload, dtype, name), value in results.items():
        runs = value if isinstance(value, list) else [value]
        done_runs = [s for s in runs if s is not None]
        if not done_runs:
            rows.append([workload, dtype, name, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        summary = done_runs[0] if len(runs) == 1 else None
        rates = [s["output_throughput"] for s in done_runs]
        tok_s = f"{rates[0]:.1f}" if summary else f"{_median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f})"
        ttft = _median([s["ttft_ms"]["median"] for s in done_runs])
        completed = sum(s["completed"] for s in done_runs)
        done = f"{completed}/{completed + sum(s['failed'] for s in done_runs)}"
        tokens = f"{sum(s['total_output_tokens'] for s in done_runs)}/{sum(s['expected_output_tokens'] for s in done_runs)}"
        if len(done_runs) < len(runs):
            done += f" ({len(runs) - len(done_runs)} runs failed)"
        hits = [s.get("server_prefix_cache_hit_rate") for s in done_runs]  # None where the server has no /metrics
        hit = "n/a" if None in hits else f"{_median(hits):.3f}"
        tok_ratio = ttft_ratio = "-"
        ours = results.get((workload, dtype, "ours")) if name != "ours" else None
        if ours is not None:
            ours_runs = ours if isinstance(ours, list) else [ours]
            pairs = [(o, p) for o, p in zip(ours_runs, runs) if o is not None and p is not None]
            if pairs:
                tok_ratio = _ratio_of([o["output_throughput"] for o, _ in pairs], [p["output_throughput"] for _, p in pairs])
                ttft_ratio = _ratio_of([o["ttft_ms"]["median"] for o, _ in pairs], [p["ttft_ms"]["median"] for _, p in pairs])
        rows.append([workload, dtype, name, done, tokens, tok_s, f"{ttft:.0f}", hit, tok_ratio, ttft_ratio])
    return rows


def _ratio_of(ours: List[float], peer: List[float]) -> str:
    """`ratio` of one pair, or the median of the pairs' ratios."""
    if len(ours) == 1:
        return ratio(ours[0], peer[0])
    ratios = [o / p for o, p in zip(ours, peer) if p]
    return f"{_median(ratios):.2f}x" if ratios else "-"


HEADER = ["workload", "dtype", "server", "requests ok", "out tokens", "out tok/s", "p50 TTFT ms", "prefix hit",
          "tok/s ours/peer", "TTFT ours/peer"]


def format_table(rows: List[List[str]]) -> str:
    """A Markdown table (README-ready)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _flag(argv: List[str], *names: str) -> Optional[str]:
    """The last value given to any of `names` in `argv` ("--name V" or "--name=V"), else None."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(*names, dest="value")
    return parser.parse_known_args(argv)[0].value


def kv_cache_dtypes(opts: argparse.Namespace, dtype: str) -> Dict[str, str]:
    """What each server stores its KV cache in for weights of `dtype`. llama-server keeps f16 K/V
    whatever the GGUF's type unless -ctk / -ctv say otherwise; ours follows the weights unless
    --kv-cache-dtype says otherwise; transformers' cache holds the model's dtype."""
    out = {}
    for name in opts.servers:
        if name == "ours":
            ours = _flag(shlex.split(opts.our_args), "--kv-cache-dtype")
            out[name] = dtype if ours in (None, "auto") else ours
        elif name == "llama.cpp":
            llama = shlex.split(opts.llama_args)
            k = _flag(llama, "-ctk", "--cache-type-k") or "f16"
            v = _flag(llama, "-ctv", "--cache-type-v") or "f16"
            out[name] = k if k == v else f"K {k} / V {v}"
        else:
            out[name] = dtype
    return out
