"""/flush_cache gives the scheduler's load-time memory back to the OS: the CPU KV pool's touched
pages (its own mappings, unmapped) and the free blocks that the raised malloc thresholds keep in
the heap (trimmed). Measured from outside, with psutil and /proc/PID/smaps, on the demo model.

Numbers the bounds come from (AMD EPYC, 2 cores; test defaults: fp32, --max-total-tokens 65536),
scheduler RSS over three rounds of 256 prompts x 64 new tokens: warm-up 364 MiB, peak 598-611,
after the flush 378 (+14); with the heap trim disabled, 476 after the flush (+112). Main heap under
a full-prompt-logprob load: 132 -> 185-195 MiB, 138 after the flush (+6); untrimmed it stays at
its peak (+63).
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from server_utils import running_server

DEMO_MODEL = Path(__file__).resolve().parent.parent / "srt" / "demo_model"
MIB = 1 << 20
MIN_GROWTH_MIB = 120  # the load must grow the scheduler clearly (measured: +234 to +247)
MAX_RESIDUAL_MIB = 60  # after the flush (measured: +14; +112 untrimmed): live objects, not caches
MIN_HEAP_GROWTH_MIB = 30  # a logprob load on the main heap (measured: +53 to +63)
MAX_HEAP_RESIDUAL_MIB = 25  # main heap after the flush (measured: +6; +63 untrimmed)

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/PID/smaps")


def _scheduler(server) -> psutil.Process:
    """The server's scheduler child, by the process title it sets (`srt::scheduler`)."""
    found = [c for c in psutil.Process(server.proc.pid).children(recursive=True)
             if c.name().startswith("srt::scheduler")]
    assert len(found) == 1, [c.name() for c in psutil.Process(server.proc.pid).children(recursive=True)]
    return found[0]


def _rss_mib(proc: psutil.Process) -> float:
    return proc.memory_info().rss / MIB


def _heap_mib(proc: psutil.Process) -> float:
    """Resident MiB of the main malloc arena (the `[heap]` mapping), where the tuned thresholds
    keep freed activations."""
    rss, in_heap = 0, False
    with open(f"/proc/{proc.pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                in_heap = line.rstrip().endswith("[heap]")
            elif in_heap and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss / 1024


def _load(server, rounds: int = 3, **extra) -> None:
    """Distinct long prompts, so the radix cache keeps filling new KV slots round after round."""
    for rnd in range(rounds):
        prompts = [f"Story {rnd}-{i}: " + "once upon a time " * (20 + (i * 37) % 45) for i in range(256)]
        params = {"max_new_tokens": 64, "temperature": 1.0, "ignore_eos": True}
        resp = server.post("/generate", json={"text": prompts, "sampling_params": params, **extra}, timeout=900)
        assert resp.status_code == 200, resp.text[:500]


def _flush(server) -> None:
    resp = server.post("/flush_cache")
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def test_flush_brings_the_scheduler_back_near_its_warm_up_rss():
    with running_server(DEMO_MODEL) as server:
        scheduler = _scheduler(server)
        warm = _rss_mib(scheduler)
        _load(server)
        peak = _rss_mib(scheduler)
        _flush(server)
        after = _rss_mib(scheduler)
    assert peak - warm > MIN_GROWTH_MIB, (warm, peak)
    assert after - warm < MAX_RESIDUAL_MIB, (warm, peak, after)


def test_flush_trims_the_heap_that_a_logprob_load_grew():
    with running_server(DEMO_MODEL) as server:
        scheduler = _scheduler(server)
        warm = _heap_mib(scheduler)
        _load(server, return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
        peak = _heap_mib(scheduler)
        _flush(server)
        after = _heap_mib(scheduler)
    assert peak - warm > MIN_HEAP_GROWTH_MIB, (warm, peak)
    assert after - warm < MAX_HEAP_RESIDUAL_MIB, (warm, peak, after)
