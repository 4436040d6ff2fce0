"""SGLang's router in front of our workers: prefix-cache hit rate and throughput per routing policy.

    python scripts/bench_router.py --model-path DIR                      # 2 workers, cache_aware vs round_robin
    python scripts/bench_router.py --model-path DIR --policies cache_aware round_robin power_of_two \\
        --groups 8 --per-group 16 --system-prompt-len 1024

Starts `--workers` servers (`launch_server --enable-metrics`, loopback), then for each policy:
flushes the workers' caches, starts `sglang-router launch --policy P`, runs `bench_serving.py
--backend openai --dataset-name generated-shared-prefix` through the router, and reads every
worker's `/metrics` prefix counters before and after. The hit rate is the sum over workers of
hit tokens / queried tokens. A cache-aware router keeps each group's requests on one worker,
so its radix cache holds the group's system prompt once; round robin spreads every group over
every worker. Prints a Markdown table; --json-out writes the rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_serving_check import Server, free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
COUNTERS = ("sglang:prefix_cache_queried_tokens_total", "sglang:prefix_cache_hit_tokens_total")
logger = logging.getLogger("bench_router")


def counters(url: str) -> Dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {k: 0.0 for k in COUNTERS}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def start_router(workers: List[str], policy: str, log_dir: Path):
    port = free_port()
    exe = str(Path(sys.executable).with_name("sglang-router"))
    cmd = [exe, "launch", "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(free_port()), "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=open(log_dir / f"router-{policy}.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"router ({policy}) not ready; see {log_dir}")


def run_policy(policy: str, workers: List[Server], args, log_dir: Path) -> Dict[str, object]:
    for w in workers:
        urllib.request.urlopen(urllib.request.Request(w.url + "/flush_cache", data=b"", method="POST"), timeout=60)
    before = [counters(w.url) for w in workers]
    proc, url = start_router([w.url for w in workers], policy, log_dir)
    out = log_dir / f"bench-{policy}.jsonl"
    try:
        cmd = [sys.executable, str(REPO / "scripts" / "bench_serving.py"), "--backend", "openai", "--base-url", url,
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
               "--gsp-prompts-per-group", str(args.per_group), "--gsp-system-prompt-len", str(args.system_prompt_len),
               "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
               "--max-concurrency", str(args.concurrency), "--output-file", str(out)]
        subprocess.run(cmd, check=True, stdout=open(log_dir / f"bench-{policy}.log", "w"), stderr=subprocess.STDOUT,
                       timeout=args.timeout)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    after = [counters(w.url) for w in workers]
    queried = sum(a[COUNTERS[0]] - b[COUNTERS[0]] for a, b in zip(after, before))
    hit = sum(a[COUNTERS[1]] - b[COUNTERS[1]] for a, b in zip(after, before))
    summary = json.loads(out.read_text().splitlines()[-1])
    per_worker = [round(a[COUNTERS[0]] - b[COUNTERS[0]]) for a, b in zip(after, before)]
    return dict(policy=policy, hit_rate=hit / queried if queried else 0.0, queried_tokens=queried, hit_tokens=hit,
                queried_per_worker=per_worker, completed=summary["completed"], failed=summary["failed"],
                output_throughput=summary["output_throughput"], request_throughput=summary["request_throughput"],
                median_ttft_ms=summary["ttft_ms"].get("median"))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_router-"))
    flags = ["--max-total-tokens", "65536", "--max-running-requests", "64"]
    workers = [Server(args.model_path, args.device, args.dtype, ["--enable-metrics"], log_dir, f"worker{i}", flags)
               for i in range(args.workers)]
    try:
        for w in workers:
            w.wait_ready(300)
        rows = [run_policy(policy, workers, args, log_dir) for policy in args.policies]
    finally:
        for w in workers:
            w.stop()
    print(f"# bench_router: {args.workers} workers of {args.model_path} ({args.device}, {args.dtype}); "
          f"{args.groups} groups x {args.per_group} prompts, {args.system_prompt_len}-token system prompts, "
          f"{args.output_len} out, concurrency {args.concurrency}")
    print("| policy | prefix hit rate | queried tokens per worker | completed | failed | output tok/s | req/s | "
          "median TTFT ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {100 * r['hit_rate']:.1f}% | {r['queried_per_worker']} | {r['completed']} | "
              f"{r['failed']} | {r['output_throughput']:.1f} | {r['request_throughput']:.2f} | "
              f"{r['median_ttft_ms']:.0f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["failed"] == 0 and r["completed"] > 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
