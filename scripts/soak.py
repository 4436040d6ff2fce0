"""Soak a running server with a mixed load, then check that nothing was lost or leaked.

    python scripts/soak.py --url http://127.0.0.1:30000 --pid <server pid> -n 5000 -c 64
    python scripts/soak.py --model-path DIR -n 5000 -c 64 -- --max-queued-requests 64
    python scripts/soak.py --model-path DIR -n 5000 -c 64 --pool-frac 0.1 -- --max-queued-requests 64

The mix (scripts/soak_requests.py): native /generate (single, stream, batch, n > 1, logprobs) and
OpenAI completions and chat, stream and not; 30% of the valid ones disconnect at a random point,
10% of all bodies are malformed or over-length, and every `--burst-every` requests a burst of
`--burst-size` small requests goes out at once, above the queue bound. At the end it asserts:
no 5xx and no other failure, nothing running or queued, KV conservation from /get_server_info
(available + evictable + protected == T, no slot protected, every request slot free) and the
server's process-tree RSS growth (after warm-up, after /flush_cache) under `--rss-bound-mib`.
`--half-open N` holds N connections with half a header through the run (the server must close
them, after its --http-header-timeout) and sends a few complete requests half-closed (SHUT_WR),
which must be answered; the mix includes the evil requests of scripts/soak_evil.py.
`--pool-frac F` (with --model-path) sizes the KV pool to F of the run's working set, so eviction
and retraction are exercised. Prints a table; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import aiohttp
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from evil_connections import half_closed_request, hold_half_open, wait_closed  # noqa: E402
from server_process import LaunchedServer, split_server_args, tree_rss_mib  # noqa: E402
from soak_requests import Outcome, SoakConfig, native_body, one_request, send  # noqa: E402


# What a flush cannot give back: oneDNN's primitive caches for the packed bf16/fp32 linears (two
# caches of 1,024 entries, one entry per (weight shape, input rows), ~0.45 MB each) fill as
# prompts of new lengths arrive and stay full, 445 MB for one weight shape on a Zen 5 EPYC
# (docs/benchmarks.md, "Soak and fuzz"); the rest of the process tree comes back.
RSS_BOUND_MIB = 768.0


@dataclass
class SoakReport:
    outcomes: List[Outcome]
    elapsed_s: float
    rss_start_mib: float
    rss_end_mib: float
    rss_flushed_mib: float
    memory: Dict[str, int]
    max_total_num_tokens: int
    idle: bool
    problems: List[str] = field(default_factory=list)
    rss_by_process: Dict[str, tuple] = field(default_factory=dict)  # title -> (after warm-up, after flush)
    half_open: int = 0  # connections held with half a header during the run
    half_open_closed_s: List[Optional[float]] = field(default_factory=list)  # when the server closed each
    half_closed_status: List[int] = field(default_factory=list)  # complete request, then SHUT_WR

    @property
    def counts(self) -> Dict[str, int]:
        return dict(collections.Counter(o.result for o in self.outcomes))

    @property
    def failures(self) -> List[Outcome]:
        return [o for o in self.outcomes if o.result == "failed"]

    @property
    def num_5xx(self) -> int:
        return sum(1 for o in self.outcomes if o.status >= 500 and o.result != "shed")

    @property
    def passed(self) -> bool:
        return not self.problems


def _server_info(url: str) -> Dict[str, Any]:
    return requests.get(url + "/get_server_info", timeout=30).json()


def _rss(pid: Optional[int]) -> float:
    return sum(tree_rss_mib(pid).values()) if pid else 0.0


async def _drive(url: str, cfg: SoakConfig, num_requests: int, concurrency: int, seed: int,
                 burst_every: int, burst_size: int) -> List[Outcome]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)
    outcomes: List[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=concurrency + burst_size + 8)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def run(req: Any, gated: bool) -> None:
            if gated:
                async with sem:
                    outcomes.append(await req)
            else:
                outcomes.append(await req)

        tasks = []
        for i in range(num_requests):
            if burst_every and i and i % burst_every == 0:
                for _ in range(burst_size):  # not gated: this is the overload
                    body = native_body(rng, cfg, "single")
                    body["sampling_params"]["max_new_tokens"] = 1
                    tasks.append(asyncio.ensure_future(run(send(
                        session, url, "burst", "/generate", body, lambda a: None if a.get("text") is not None
                        else "no text", False, None, cfg.deadline_s), gated=False)))
            tasks.append(asyncio.ensure_future(run(one_request(rng, cfg, url, session), gated=True)))
            if len(tasks) >= 4 * concurrency:  # keep the number of pending tasks bounded
                done = [t for t in tasks if t.done()]
                tasks = [t for t in tasks if not t.done()]
                if not done:
                    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*tasks)
    return outcomes


def _wait_idle(url: str, timeout: float = 120.0) -> Dict[str, Any]:
    """The server info once nothing runs, waits or is tracked by the front end (or at timeout)."""
    deadline = time.monotonic() + timeout
    info = _server_info(url)
    while time.monotonic() < deadline:
        load = info.get("load") or {}
        if not load.get("num_running_reqs") and not load.get("num_waiting_reqs") and not info["num_front_end_requests"]:
            return info
        time.sleep(0.5)
        info = _server_info(url)
    return info


def run_soak(url: str, pid: Optional[int], num_requests: int, concurrency: int, seed: int = 0,
             max_new_tokens: int = 8, disconnect_frac: float = 0.3, burst_every: int = 200,
             burst_size: int = 0, rss_bound_mib: float = RSS_BOUND_MIB, warmup: int = 32, half_open: int = 0,
             half_open_timeout_s: float = 60.0) -> SoakReport:
    """Drive the load and run the end-of-soak checks; `burst_size` 0 means queue bound + 16.
    `half_open` connections send half a header at the start and must be closed by the server
    within `half_open_timeout_s` of it (its --http-header-timeout plus slack); a few complete
    requests sent half-closed (SHUT_WR) must be answered."""
    info = _server_info(url)
    cfg = SoakConfig(context_len=info["context_length"], max_new_tokens=max_new_tokens,
                     disconnect_frac=disconnect_frac)
    if not burst_size:
        burst_size = int(info.get("max_queued_requests") or 64) + 16
    asyncio.run(_drive(url, cfg, warmup, min(concurrency, warmup), seed + 1, 0, 0))
    _wait_idle(url)
    rss_start, by_start = _rss(pid), (tree_rss_mib(pid) if pid else {})
    start = time.monotonic()
    held = hold_half_open(url, half_open) if half_open else []
    closed_s: List[Optional[float]] = []  # watched beside the load, so each close time is the server's
    watcher = threading.Thread(target=lambda: closed_s.extend(wait_closed(held, half_open_timeout_s, start)))
    watcher.start()
    outcomes = asyncio.run(_drive(url, cfg, num_requests, concurrency, seed, burst_every, burst_size))
    elapsed = time.monotonic() - start
    watcher.join()
    small = json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()
    half_closed = [half_closed_request(url, body=small)[0] for _ in range(4 if half_open else 0)]
    info = _wait_idle(url)
    rss_end = _rss(pid)
    flushed = requests.post(url + "/flush_cache", timeout=60).status_code == 200
    rss_flushed, by_end = _rss(pid), (tree_rss_mib(pid) if pid else {})
    load = info.get("load") or {}
    report = SoakReport(outcomes, elapsed, rss_start, rss_end, rss_flushed, dict(load.get("memory") or {}),
                        int(info["max_total_num_tokens"]), not load.get("num_running_reqs"))
    report.rss_by_process = {k: (by_start.get(k, 0.0), v) for k, v in by_end.items()}
    report.half_open, report.half_open_closed_s, report.half_closed_status = half_open, closed_s, half_closed
    _check(report, info, flushed, rss_bound_mib, pid is not None)
    return report


def _check(report: SoakReport, info: Dict[str, Any], flushed: bool, rss_bound_mib: float, has_pid: bool) -> None:
    p = report.problems
    if report.num_5xx:
        first = next(o for o in report.outcomes if o.status >= 500 and o.result != "shed")
        p.append(f"{report.num_5xx} responses were 5xx (queue-full 503s excluded); first: {first.kind} "
                 f"{first.result} {first.status} {first.detail}")
    if report.failures:
        first = report.failures[0]
        p.append(f"{len(report.failures)} requests failed; first: {first.kind} {first.status} {first.detail}")
    load = info.get("load") or {}
    if load.get("num_running_reqs") or load.get("num_waiting_reqs") or info["num_front_end_requests"]:
        p.append(f"not idle at the end: running {load.get('num_running_reqs')}, waiting "
                 f"{load.get('num_waiting_reqs')}, front end {info['num_front_end_requests']}")
    m = report.memory
    if not m:
        p.append("the load report has no memory accounting")
    else:
        total = m["available_size"] + m["evictable_size"] + m["protected_size"]
        if total != report.max_total_num_tokens or m["protected_size"]:
            p.append(f"KV conservation: {m} sums to {total}, T = {report.max_total_num_tokens}")
        if m["num_free_req_slots"] != m["num_req_slots"]:
            p.append(f"request slots in use at the end: {m['num_req_slots'] - m['num_free_req_slots']}")
    if not flushed:
        p.append("/flush_cache refused at the end (the server does not think it is idle)")
    still_open = sum(1 for t in report.half_open_closed_s if t is None)
    if still_open:
        p.append(f"{still_open} of {report.half_open} half-open connections were not closed by the server")
    if any(status != 200 for status in report.half_closed_status):
        p.append(f"half-closed requests got {report.half_closed_status}, expected 200s")
    if has_pid and report.rss_flushed_mib - report.rss_start_mib > rss_bound_mib:
        p.append(f"RSS grew {report.rss_flushed_mib - report.rss_start_mib:.0f} MiB (bound {rss_bound_mib:.0f})")


def format_report(report: SoakReport) -> str:
    kinds = collections.defaultdict(collections.Counter)
    for o in report.outcomes:
        kinds[o.kind][o.result] += 1
    cols = ["ok", "refused", "shed", "disconnected", "failed"]
    lines = ["| kind | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for kind in sorted(kinds):
        lines.append(f"| {kind} | " + " | ".join(str(kinds[kind][c]) for c in cols) + " |")
    total = collections.Counter(o.result for o in report.outcomes)
    lines.append("| **all** | " + " | ".join(str(total[c]) for c in cols) + " |")
    rate = len(report.outcomes) / report.elapsed_s if report.elapsed_s else 0.0
    lines += ["", f"{len(report.outcomes)} requests in {report.elapsed_s:.1f} s ({rate:.1f} req/s); 5xx: "
                  f"{report.num_5xx}; memory at the end: {report.memory} of T = {report.max_total_num_tokens}",
              f"server RSS (process tree): {report.rss_start_mib:.0f} MiB after warm-up, {report.rss_end_mib:.0f} "
              f"at the end, {report.rss_flushed_mib:.0f} after /flush_cache; per process: " + ", ".join(
                  f"{k} {a:.0f} -> {b:.0f}" for k, (a, b) in sorted(report.rss_by_process.items())),
              _half_open_line(report),
              "PASS" if report.passed else "FAIL: " + "; ".join(report.problems)]
    return "\n".join(lines)


def _half_open_line(report: SoakReport) -> str:
    closed = sorted(t for t in report.half_open_closed_s if t is not None)
    if not report.half_open:
        return "half-open connections: none held"
    worst = f", the last after {closed[-1]:.1f} s" if closed else ""
    return (f"half-open connections: {len(closed)} of {report.half_open} closed by the server{worst}; "
            f"half-closed requests: {report.half_closed_status}")


def main(argv: Optional[List[str]] = None) -> int:
    own, server_args = split_server_args(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else --model-path launches one)")
    ap.add_argument("--pid", type=int, help="the running server's pid, for the RSS check")
    ap.add_argument("--model-path")
    ap.add_argument("-n", "--num-requests", type=int, default=1000)
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--disconnect-frac", type=float, default=0.3)
    ap.add_argument("--burst-every", type=int, default=200)
    ap.add_argument("--burst-size", type=int, default=0, help="0: the server's --max-queued-requests + 16")
    ap.add_argument("--rss-bound-mib", type=float, default=RSS_BOUND_MIB)
    ap.add_argument("--pool-frac", type=float, help="with --model-path: KV pool = this fraction of the working set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--half-open", type=int, default=0, help="connections held with half a header during the run")
    ap.add_argument("--half-open-timeout-s", type=float, default=60.0,
                    help="the server must close them within this (its --http-header-timeout plus slack)")
    args = ap.parse_args(own)
    server = None
    if args.url is None:
        if not args.model_path:
            ap.error("give --url of a running server or --model-path to launch one")
        if args.pool_frac:
            # Working set: every concurrent request's prompt (up to ~60 tokens with a chat
            # template) plus its output, n > 1 and batches counted up to 4 sequences each.
            working_set = args.concurrency * 4 * (64 + args.max_new_tokens)
            server_args = ["--max-total-tokens", str(max(256, int(working_set * args.pool_frac)))] + server_args
        if "--max-queued-requests" not in server_args:
            server_args = ["--max-queued-requests", str(2 * args.concurrency)] + server_args
        server = LaunchedServer(args.model_path, server_args)
    try:
        url, pid = (args.url, args.pid) if server is None else (server.url, server.pid)
        report = run_soak(url, pid, args.num_requests, args.concurrency, args.seed, args.max_new_tokens,
                          args.disconnect_frac, args.burst_every, args.burst_size, args.rss_bound_mib,
                          half_open=args.half_open, half_open_timeout_s=args.half_open_timeout_s)
        print(format_report(report))
        return 0 if report.passed else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
