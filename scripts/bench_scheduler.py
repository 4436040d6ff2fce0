"""Scheduler overhead per step with a no-op model runner (random logits, no model).

    python scripts/bench_scheduler.py --running 8 64 256

Times admission (receive + prefill batch choice), batch preparation (`prepare_for_decode`,
including the sampling tensors), and result processing (tokens, finish checks, outputs) of
decode steps at a steady number of running requests. Prints µs per step (median, p99).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from managers.io_struct import TokenizedGenerateReqInput  # noqa: E402
from managers.scheduler import Scheduler  # noqa: E402
from mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from srt.layers.sampler import Sampler  # noqa: E402
from srt.sampling.sampling_params import SamplingParams  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402

VOCAB = 32000


class NoopRunner:
    """Pools and limits like a ModelRunner; forward returns random logits without a model."""

    def __init__(self, max_tokens: int, max_running: int, context_len: int = 4096):
        self.device, self.page_size = "cpu", 1
        self.model_config = SimpleNamespace(vocab_size=VOCAB, context_len=context_len, eos_token_ids={2})
        self.max_total_num_tokens = max_tokens
        self.max_running_requests = max_running
        self.max_req_len = min(context_len - 1, max_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len + 4)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_tokens)
        self.token_to_kv_pool = None
        self.attn_backend = None
        self.sampler = Sampler()
        self.gen = torch.Generator().manual_seed(0)

    def forward(self, fb):
        return LogitsProcessorOutput(torch.randn(fb.batch_size, VOCAB, generator=self.gen))

    def sample(self, logits_output, fb, **kw):
        return self.sampler(logits_output.next_token_logits, fb.sampling_info, positions=fb.seq_lens, **kw)


def timed(obj, name, sink):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        out = fn(*a, **k)
        sink[name] = sink.get(name, 0.0) + time.perf_counter() - t
        return out

    setattr(obj, name, wrapper)


def bench(running: int, steps: int, temperature: float) -> dict:
    args = ServerArgs(model_path="unused", device="cpu")
    runner = NoopRunner(max_tokens=running * 1200 + 1024, max_running=running)
    sched = Scheduler(args, runner)
    sp = dict(max_new_tokens=10**6, ignore_eos=True, temperature=temperature)
    for i in range(running):
        sched.process_input(TokenizedGenerateReqInput(f"r{i}", [5 + i % 100] * 64, SamplingParams(**sp)))
    while len(sched.running_batch.reqs) < running:  # prefill everyone
        sched.step()
    parts: dict = {}
    from managers.schedule_batch import ScheduleBatch
    timed(sched, "get_next_batch_to_run", parts)
    timed(sched.running_batch, "prepare_for_decode", parts)
    timed(sched, "process_batch_result_decode", parts)
    timed(runner, "forward", parts)
    timed(runner, "sample", parts)
    rows = []
    for _ in range(steps):
        parts.clear()
        t = time.perf_counter()
        sched.step()
        total = time.perf_counter() - t
        model = parts.get("forward", 0.0) + parts.get("sample", 0.0)
        rows.append((total - model, parts.get("get_next_batch_to_run", 0.0),
                     parts.get("prepare_for_decode", 0.0), parts.get("process_batch_result_decode", 0.0)))
    assert len(sched.running_batch.reqs) == running, "requests finished or were retracted during the run"
    cols = list(zip(*rows))
    med = [statistics.median(c) * 1e6 for c in cols]
    p99 = [sorted(c)[int(0.99 * (len(c) - 1))] * 1e6 for c in cols]
    return dict(running=running, total=med[0], p99=p99[0], admission=med[1], prepare=med[2], process=med[3])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    print(f"# bench_scheduler: no-op runner, vocab {VOCAB}, temperature {args.temperature}, "
          f"{args.steps} decode steps, threads={torch.get_num_threads()}; µs per step excluding the forward and the sampler")
    print("| running | overhead median µs | p99 µs | admission µs | batch prep µs | result processing µs | µs per request |")
    print("|---|---|---|---|---|---|---|")
    for n in args.running:
        r = bench(n, args.steps, args.temperature)
        print(f"| {n} | {r['total']:.0f} | {r['p99']:.0f} | {r['admission']:.0f} | {r['prepare']:.0f} | "
              f"{r['process']:.0f} | {r['total'] / n:.1f} |", flush=True)


if __name__ == "__main__":
    main()
