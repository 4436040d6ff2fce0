"""End-to-end serving check: the same greedy requests through a reference server and a candidate
server (`launch_server` subprocesses on loopback), compared token by token.

    python scripts/gpu_serving_check.py --model-path DIR --device cuda --dtype float32 --json-out r.json
    python scripts/gpu_serving_check.py --model-path DIR --device cuda --dtype bfloat16
    python scripts/gpu_serving_check.py --model-path DIR --device cpu --dtype float32   # self-check on CPU

The reference is always `--device cpu --dtype float32 --attention-backend torch_native`. Both servers
run with `--page-size 16 --chunked-prefill-size 32` and get 32 greedy prompts (4 groups of 8
sharing a 48-token prefix, so the radix cache and chunked prefill both work), returning logprobs
with the top TOP_K, plus one n = 2 request. The candidate's warm-up (launch_server's 4-token generation)
must pass for it to start at all.

Pass rule: fp32 candidates must give identical tokens. Lower precision may diverge only at a near
tie: at the first position where the tokens differ, the candidate's token must be among the
reference's top TOP_K with a logprob within --tie-nats (default 0.25) of the reference's first
choice (bf16 can reorder three nearly equal tokens: on the H200, qwen3 picked the reference's
third choice where its first two were 0.0005 nats apart). Only stdlib is used.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
COMMON_FLAGS = ["--page-size", "16", "--chunked-prefill-size", "32", "--max-total-tokens", "16384",
                "--max-running-requests", "64"]
TOP_K = 5  # reference logprobs kept per position, for the near-tie rule
logger = logging.getLogger("gpu_serving_check")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: Dict[str, Any], timeout: float = 300.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Server:
    def __init__(self, model: str, device: str, dtype: str, extra: List[str], log_dir: Path, name: str,
                 common: Optional[List[str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{name}.log"
        cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", model, "--device", device,
               "--dtype", dtype, "--port", str(self.port), *(COMMON_FLAGS if common is None else common), *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
        self.cmd = cmd
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def wait_ready(self, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health_generate", timeout=30) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                time.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_prompts(vocab: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(4):
        prefix = [rng.randrange(3, vocab) for _ in range(48)]
        for _ in range(8):
            prompts.append(prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(8, 40))])
    return prompts


def run_requests(url: str, prompts: List[List[int]], max_new: int) -> Dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    batch = post(url + "/generate", {"input_ids": prompts, "sampling_params": params, "return_logprob": True,
                                     "top_logprobs_num": TOP_K})
    fan = post(url + "/generate", {"input_ids": prompts[0], "sampling_params": dict(params, n=2)})
    return {"batch": batch, "n2": fan}


def compare(ref: Dict[str, Any], cand: Dict[str, Any], exact: bool, tie_nats: float) -> Dict[str, Any]:
    identical, near_ties, failures = 0, 0, []
    for i, (r, c) in enumerate(zip(ref["batch"], cand["batch"])):
        a, b = r["output_ids"], c["output_ids"]
        if a == b:
            identical += 1
            continue
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        top = r["meta_info"]["output_top_logprobs"][j]  # [[logprob, id], ...] best first
        tie = any(entry[1] == b[j] and top[0][0] - entry[0] <= tie_nats for entry in top[1:])
        if tie and not exact:
            near_ties += 1
        else:
            failures.append(dict(prompt=i, position=j, reference=a[j], candidate=b[j], reference_top=top))
    n2 = cand["n2"]
    n2_ok = isinstance(n2, list) and len(n2) == 2 and n2[0]["output_ids"] == n2[1]["output_ids"]
    if not n2_ok:
        failures.append(dict(n2="the two greedy children of an n = 2 request differ"))
    return dict(prompts=len(ref["batch"]), identical=identical, near_ties=near_ties, failures=failures,
                n2_ok=n2_ok, passed=not failures)


def main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more candidate flags (last)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--tie-nats", type=float, default=0.25)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--json-out")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gpu_serving_check-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab)
    name = f"{Path(args.model_path).name}-{args.device}-{args.dtype}-{args.attention_backend}"
    ref = Server(args.model_path, "cpu", "float32", ["--attention-backend", "torch_native"], log_dir, name + "-ref")
    cand = Server(args.model_path, args.device, args.dtype, ["--attention-backend", args.attention_backend,
                                                             *args.extra], log_dir, name)
    result: Dict[str, Any] = dict(model=args.model_path, device=args.device, dtype=args.dtype,
                                  attention_backend=args.attention_backend, extra=args.extra)
    try:
        ref.wait_ready(args.start_timeout)
        result["candidate_ready_s"] = round(cand.wait_ready(args.start_timeout), 1)
        reference = run_requests(ref.url, prompts, args.max_new_tokens)
        t0 = time.perf_counter()
        candidate = run_requests(cand.url, prompts, args.max_new_tokens)
        result["candidate_requests_s"] = round(time.perf_counter() - t0, 2)
        result.update(compare(reference, candidate, exact=args.dtype in ("float32", "float"), tie_nats=args.tie_nats))
        result["candidate_log_tail"] = cand.tail(1500)
    except Exception as exc:  # the reason, and the server's own last lines
        result.update(passed=False, error=f"{type(exc).__name__}: {exc}", candidate_log_tail=cand.tail(3000))
    finally:
        ref.stop()
        cand.stop()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    summary = {k: result.get(k) for k in ("device", "dtype", "attention_backend", "prompts", "identical",
                                           "near_ties", "n2_ok", "candidate_ready_s", "passed", "error")}
    logger.info("gpu_serving_check %s: %s", name, json.dumps(summary))
    for failure in result.get("failures", [])[:5]:
        logger.info("  mismatch: %s", failure)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
