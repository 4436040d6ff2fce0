"""One request must not take the server down: measure what hostile requests cost everyone else.

    python scripts/bench_evil.py --model-path srt/demo_model      # launches a server
    python scripts/bench_evil.py --url http://127.0.0.1:30000

Two tables. "Catastrophic stop patterns": each request forces one character (logit_bias on the
token of "a") under a stop_regex that backtracks exponentially in Python's `re`, beside a
3,000-character stop string that never matches; a second process measures the p50 latency of
1-token requests before (idle) and while it runs. "Large requests": /health's worst latency, from a
second process, while each big body is sent, with the status it got. Prints markdown; exits 1 when
a check of the issue's bar fails (the server down, a catastrophic request not ended, p50 over 2x
idle, /health over 200 ms).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evil_connections import machine_name  # noqa: E402
from server_process import LaunchedServer, split_server_args  # noqa: E402

CATASTROPHIC = ["(a+)+b", "(a|aa)+$", "(.*a){20}$", "((a*)*)*b"]
HEALTH_BOUND_MS, P50_BOUND = 200.0, 2.0
# Probes run in fresh interpreters: a fork while the request thread holds an import lock deadlocks.
MP = mp.get_context("spawn")


def _one_token_latencies(url: str, seconds: float, out: "mp.Queue", min_count: int = 10) -> None:
    """Child process: 1-token /generate requests back to back for `seconds` (at least `min_count`)."""
    session, lat, end = requests.Session(), [], time.monotonic() + seconds
    while time.monotonic() < end or len(lat) < min_count:
        t = time.perf_counter()
        session.post(url + "/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 1}},
                     timeout=120)
        lat.append(time.perf_counter() - t)
    out.put(lat)


def _health_latencies(url: str, stop: Any, out: "mp.Queue") -> None:
    session, lat = requests.Session(), []
    while not stop.is_set():
        t = time.perf_counter()
        try:
            session.get(url + "/health", timeout=120)
        except requests.RequestException:
            pass
        lat.append(time.perf_counter() - t)
        time.sleep(0.01)
    out.put(lat)


def p50_one_token(url: str, seconds: float) -> float:
    q: "mp.Queue" = MP.Queue()
    p = MP.Process(target=_one_token_latencies, args=(url, seconds, q))
    p.start()
    lat = q.get()
    p.join()
    return statistics.median(lat)


def forced_token(url: str, model_path: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """How to force "a" every step: logit_bias on its token when the tokenizer is at hand, else a regex."""
    path = model_path or requests.get(url + "/get_model_info", timeout=30).json().get("tokenizer_path")
    try:
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(path).encode("a", add_special_tokens=False)
        if len(ids) == 1:
            return f"logit_bias {{{ids[0]}: 100}}", {"logit_bias": {str(ids[0]): 100}}
    except (OSError, ValueError, ImportError):
        pass
    return "regex a{300}", {"regex": "a{300}"}


def catastrophic_rows(url: str, model_path: Optional[str], seconds: float) -> Tuple[List[str], List[str]]:
    how, force = forced_token(url, model_path)
    idle = p50_one_token(url, seconds)
    rows, problems = [], []
    for pattern in CATASTROPHIC:
        body = {"text": "Once", "sampling_params": {"max_new_tokens": 300, "temperature": 0, "ignore_eos": True,
                                                     "stop": ["z" * 3000], "stop_regex": pattern, **force}}
        result: Dict[str, Any] = {}

        def run(body: Dict[str, Any] = body) -> None:
            t = time.perf_counter()
            r = requests.post(url + "/generate", json=body, timeout=600)
            result.update(status=r.status_code, seconds=time.perf_counter() - t,
                          finish=(r.json().get("meta_info") or {}).get("finish_reason") if r.ok else r.text[:120])

        thread = threading.Thread(target=run)
        thread.start()
        during = p50_one_token(url, seconds)
        thread.join()
        ratio = during / idle
        finish = result.get("finish")
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        rows.append(f"| `{pattern}` | {result.get('status')} | {kind} | {result.get('seconds', 0):.2f} | "
                    f"{idle * 1000:.1f} | {during * 1000:.1f} | {ratio:.2f}x |")
        if result.get("status") != 200 or kind not in ("stop", "length"):
            problems.append(f"{pattern}: status {result.get('status')}, finish {finish}")
        if ratio > P50_BOUND:
            problems.append(f"{pattern}: p50 1-token latency {ratio:.2f}x idle")
    header = [f"Forcing: {how}; 1-token p50 sampled for {seconds:g} s at a time.", "",
              "| stop_regex | status | finish | request s | idle p50 ms | p50 during ms | ratio |",
              "|---|---|---|---|---|---|---|"]
    return header + rows, problems


def large_cases(url: str) -> List[Tuple[str, str, Callable[[], bytes]]]:
    msgs = lambda n: [{"role": "user", "content": "a"}] * n  # noqa: E731
    return [
        ("30 MB stop string", "/generate",
         lambda: json.dumps({"text": "hi", "sampling_params": {"stop": "x" * (30 << 20)}}).encode()),
        ("900k chat messages", "/v1/chat/completions",
         lambda: json.dumps({"model": "m", "messages": msgs(900_000), "max_tokens": 2}).encode()),
        ("1M logit_bias keys", "/generate",
         lambda: json.dumps({"text": "hi", "sampling_params": {"logit_bias": {str(i): 0.5 for i in range(10**6)}}}).encode()),
        ("2 x 1M input_ids", "/generate", lambda: json.dumps({"input_ids": [[1] * 10**6] * 2}).encode()),
        ("10,000 stop_regex", "/generate",
         lambda: json.dumps({"text": "hi", "sampling_params": {"stop_regex": [f"x{i}y" for i in range(10**4)]}}).encode()),
        ("top_logprobs_num 10**9", "/generate",
         lambda: json.dumps({"text": "hi", "return_logprob": True, "top_logprobs_num": 10**9}).encode()),
        ("1 MB rid", "/generate", lambda: json.dumps({"text": "hi", "rid": "r" * (1 << 20)}).encode()),
        ("top_logprobs_num 20 (the cap), 8 x 300 tokens", "/generate",
         lambda: json.dumps({"text": ["hi"] * 8, "return_logprob": True, "top_logprobs_num": 20,
                             "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}).encode()),
        ("4,096 chat messages (the cap)", "/v1/chat/completions",
         lambda: json.dumps({"model": "m", "messages": msgs(4096), "max_tokens": 2}).encode()),
    ]


def large_rows(url: str) -> Tuple[List[str], List[str]]:
    rows, problems = [], []
    for name, path, make in large_cases(url):
        data = make()
        stop, q = MP.Event(), MP.Queue()
        p = MP.Process(target=_health_latencies, args=(url, stop, q))
        p.start()
        time.sleep(0.3)
        t = time.perf_counter()
        r = requests.post(url + path, data=data, headers={"Content-Type": "application/json"}, timeout=600)
        took = time.perf_counter() - t
        time.sleep(0.1)
        stop.set()
        lat = q.get()
        p.join()
        worst = max(lat) * 1000
        message = r.json()["error"]["message"][:90] if r.status_code >= 400 else "served"
        rows.append(f"| {name} | {len(data) / 1e6:.1f} | {r.status_code} | {took:.2f} | {worst:.1f} | {message} |")
        if r.status_code >= 500 or worst > HEALTH_BOUND_MS:
            problems.append(f"{name}: status {r.status_code}, /health worst {worst:.0f} ms")
    header = ["| request | body MB | status | s | /health worst ms | answer |", "|---|---|---|---|---|---|"]
    return header + rows, problems


def main(argv: Optional[List[str]] = None) -> int:
    own, server_args = split_server_args(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else --model-path launches one)")
    ap.add_argument("--model-path")
    ap.add_argument("--seconds", type=float, default=3.0, help="1-token latency sampling window")
    args = ap.parse_args(own)
    server = None
    if args.url is None:
        if not args.model_path:
            ap.error("give --url of a running server or --model-path to launch one")
        server = LaunchedServer(args.model_path, server_args)
    try:
        url = args.url or server.url
        cat, p1 = catastrophic_rows(url, args.model_path, args.seconds)
        big, p2 = large_rows(url)
        alive = requests.get(url + "/health", timeout=30).status_code == 200
        print(f"CPU: {machine_name()}\n\n" + "\n".join(cat) + "\n\n" + "\n".join(big))
        problems = p1 + p2 + ([] if alive else ["the server is not healthy at the end"])
        print("\nPASS" if not problems else "\nFAIL: " + "; ".join(problems))
        return 0 if not problems else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
