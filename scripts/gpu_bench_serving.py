"""gpu_check step 5: `bench_serving.py` (256 shared-prefix requests, concurrency 64) against a CUDA
server of the given model; writes RESULTS/bench_serving.jsonl and prints the benchmark's table.

    python scripts/gpu_bench_serving.py --model-path DIR --results DIR [--device cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_serving_check import Server  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=64)
    args = p.parse_args()
    results = Path(args.results)
    server = Server(args.model_path, args.device, args.dtype, ["--enable-metrics"],
                    Path(tempfile.mkdtemp()), "bench")
    try:
        server.wait_ready(300)
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_serving.py"), "--base-url", server.url,
               "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
               "--gsp-prompts-per-group", str(args.per_group), "--gsp-system-prompt-len", "1024",
               "--gsp-question-len", "64", "--gsp-output-len", "32", "--max-concurrency", str(args.concurrency),
               "--output-file", str(results / "bench_serving.jsonl")]
        return subprocess.run(cmd, timeout=240).returncode
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
