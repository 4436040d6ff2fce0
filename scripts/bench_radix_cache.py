"""Benchmark our radix prefix cache against SGLang's own `RadixCache` on identical traces.

Traces (page sizes 1 and 16): multi-turn chat (200 conversations x 8 turns, vocab 32000,
50-200 user + 100-400 reply tokens per turn); shared prefix (64 groups x 16 prompts of
2048 + 128 tokens); the chat trace again under a 200k-token pool (eviction-heavy); one
32k-token sequence matched fully and to a 16k fork, and inserted into an empty tree, again when
present, and as a fork; evict(1000) and 1% from 100k- and 1M-token trees.

Both caches see the same token lists (fresh Python ints, as from a tokenizer), the same KV slot
tensors and the same allocator, in lockstep: each step runs on one cache then the other (the
order alternating), so load from other processes hits both alike. Each row gives our median / p99 / min in microseconds, SGLang's
median / min, and the speedup (SGLang time / ours; > 1 means we are faster) at the median and
at the min, which is the better guide when other processes share the CPU. Rows marked "ours
only" (reused key, from_packed) have no SGLang counterpart. "total" rows add up every timed
op of a trace. SGLang 0.4.10.post2 is loaded with its GPU-only imports stubbed out.

Usage: PYTHONPATH=. python scripts/bench_radix_cache.py [--quick] [--no-sglang]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import types
from array import array
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache, RadixKey

VOCAB = 32000
Samples = Dict[str, Tuple[List[float], str]]  # op -> (microseconds, note)
ROWS: List[Tuple[str, ...]] = []


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def load_sglang_radix_cache():
    """SGLang's RadixCache class, or None. Its allocator / memory-pool modules import triton;
    the radix cache only uses them for type hints, so stand-ins are enough."""
    for name, attr in (("sglang.srt.mem_cache.allocator", "BaseTokenToKVPoolAllocator"),
                       ("sglang.srt.mem_cache.memory_pool", "ReqToTokenPool")):
        if name not in sys.modules:
            stub = types.ModuleType(name)
            setattr(stub, attr, type(attr, (), {}))
            sys.modules[name] = stub
    try:
        from sglang.srt.mem_cache.radix_cache import RadixCache as SGLangRadixCache
    except ImportError as e:
        print(f"SGLang's RadixCache is not importable ({e}); running ours only")
        return None
    return SGLangRadixCache


def make_alloc(page: int, pool_tokens: int):
    return TokenToKVPoolAllocator(pool_tokens) if page == 1 else PagedTokenToKVPoolAllocator(pool_tokens, page)


class Ours:
    """Our cache behind the calls the traces make (token lists in, slots and nodes out)."""

    name = "ours"

    def __init__(self, page: int, pool_tokens: int):
        self.alloc, self.page_size = make_alloc(page, pool_tokens), page
        self.cache = RadixCache(None, self.alloc, page_size=page)

    def match(self, ids) -> Tuple[torch.Tensor, object]:
        m = self.cache.match_prefix(ids if isinstance(ids, RadixKey) else RadixKey(ids))
        return m.device_indices, m.last_node

    def insert(self, ids: List[int], value: torch.Tensor) -> int:
        return self.cache.insert(ids, value)  # a list, as SGLang's insert is given

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens)

    def lock(self, node) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node) -> None:
        self.cache.dec_lock_ref(node)

    def total_size(self) -> int:
        return self.cache.total_size()

    def check(self) -> None:
        self.cache.check_invariants()


class SGLang(Ours):
    name = "sglang"
    cls = None

    def __init__(self, page: int, pool_tokens: int):
        self.alloc, self.page_size = make_alloc(page, pool_tokens), page
        self.cache = self.cls(None, self.alloc, page_size=page)

    def match(self, ids) -> Tuple[torch.Tensor, object]:
        m = self.cache.match_prefix(ids)
        return m.device_indices, m.last_device_node

    def insert(self, ids: List[int], value: torch.Tensor) -> int:
        return self.cache.insert(ids, value)

    def evict(self, num_tokens: int) -> int:
        before = self.cache.evictable_size()  # SGLang's evict returns nothing
        self.cache.evict(num_tokens)
        return before - self.cache.evictable_size()

    def check(self) -> None:
        pass


def rand_tokens(rng: random.Random, n: int) -> array:
    return array("i", (rng.randrange(VOCAB) for _ in range(n)))


class Run:
    """One cache under a trace in lockstep with the others: its samples per op."""

    def __init__(self, cache: Ours):
        self.c = cache
        self.out: Dict[str, List[float]] = {}
        self.notes: Dict[str, str] = {}
        self.prompts = self.cached = self.evicted = 0

    def time(self, op: str, fn: Callable, *args):
        t0 = now_us()
        got = fn(*args)
        self.out.setdefault(op, []).append(now_us() - t0)
        return got

    def samples(self) -> Samples:
        return {op: (s, self.notes.get(op, "")) for op, s in self.out.items()}


def lockstep(runs: List[Run], step: Callable[[Run], None], reps: int = 1) -> None:
    """`step` on every cache in turn, `reps` times; the order alternates, so a burst of load
    from other processes lands on both caches alike."""
    for r in range(reps):
        for run in (runs if r % 2 == 0 else runs[::-1]):
            step(run)


def serve(run: Run, prompt: List[int], reply: List[int]) -> None:
    """One request's cache traffic, as `cache_finished_req` does it: match (L-1 cap), lock,
    allocate (evicting if short), insert the page-aligned committed tokens, free duplicates and
    the tail, unlock."""
    c = run.c
    P = c.page_size
    indices, node = run.time("match", c.match, prompt[: len(prompt) - 1])
    cached = len(indices)
    run.prompts, run.cached = run.prompts + len(prompt), run.cached + cached
    c.lock(node)
    full = prompt + reply
    committed = len(full) - 1 if reply else len(full)
    need = -(-(committed - cached) // P) * P
    if c.alloc.available_size() < need:
        run.evicted += run.time("evict", c.evict, need - c.alloc.available_size())
    fresh = c.alloc.alloc(need)
    if fresh is None:
        raise RuntimeError("pool too small for one request even after eviction")
    value = torch.cat((indices, fresh[: committed - cached]))
    aligned = committed - committed % P
    present = run.time("insert", c.insert, full[:aligned], value if aligned == committed else value[:aligned])
    c.alloc.free(torch.cat((value[cached:present], value[aligned:])))
    c.unlock(node)


def chat_trace(convs: int, turns: int, seed: int = 0) -> List[Tuple[int, array, array]]:
    """Turn t of every conversation, then turn t+1: (conversation, user tokens, reply tokens)."""
    rng = random.Random(seed)
    return [(c, rand_tokens(rng, rng.randint(50, 200)), rand_tokens(rng, rng.randint(100, 400)))
            for _ in range(turns) for c in range(convs)]


def finish_trace(runs: List[Run]) -> List[Samples]:
    for run in runs:
        run.c.check()
        run.notes["match"] = f"hit rate {100.0 * run.cached / max(run.prompts, 1):.1f}%"
        if "evict" in run.out:
            run.notes["evict"] = f"{run.evicted} tokens in {len(run.out['evict'])} calls"
        run.out["total (match+insert+evict)"] = sum((run.out.get(op, []) for op in ("match", "insert", "evict")), [])
    return [run.samples() for run in runs]


def run_chat(impls, page: int, pool_tokens: int, convs: int, turns: int) -> List[Samples]:
    runs = [Run(impl(page, pool_tokens)) for impl in impls]
    history: Dict[int, array] = {}
    gc.collect()
    for conv, user, reply in chat_trace(convs, turns):
        hist = history.setdefault(conv, array("i"))
        prompt = hist + user
        lockstep(runs, lambda run: serve(run, prompt.tolist(), reply.tolist()))  # fresh int objects
        hist.extend(user)
        hist.extend(reply)
    return finish_trace(runs)


def run_shared_prefix(impls, page: int, groups: int = 64, per_group: int = 16) -> List[Samples]:
    rng = random.Random(1)
    prefixes = [rand_tokens(rng, 2048) for _ in range(groups)]
    order = [(g, i) for i in range(per_group) for g in range(groups)]
    rng.shuffle(order)
    runs = [Run(impl(page, 1 << 22)) for impl in impls]
    gc.collect()
    for g, _ in order:
        prompt = prefixes[g] + rand_tokens(rng, 128)
        lockstep(runs, lambda run: serve(run, prompt.tolist(), []))
    return finish_trace(runs)


def run_long(impls, page: int, reps: int) -> List[Samples]:
    rng = random.Random(2)
    seq = rand_tokens(rng, 32768)
    fork = seq[:16384] + rand_tokens(rng, 16384)
    fork[16384] = (seq[16384] + 1) % VOCAB  # diverge exactly at 16k
    miss = array("i", [(seq[0] + 1) % VOCAB]) + seq[1:]
    runs = [Run(impl(page, 1 << 17)) for impl in impls]

    def fresh_tree(run: Run, with_seq: bool = True) -> None:
        run.c = type(run.c)(page, 1 << 17)
        if with_seq:
            run.c.insert(seq.tolist(), run.c.alloc.alloc(32768))

    def match(op: str, ids: array) -> Callable[[Run], None]:
        return lambda run: run.time(op, run.c.match, ids.tolist())

    lockstep(runs, fresh_tree)
    gc.collect()
    lockstep(runs, match("match full (fresh key)", seq), reps)
    reused, packed = RadixKey(seq.tolist()), seq.tobytes()
    lockstep(runs[:1], lambda run: run.time("match full (reused key), ours only", run.c.match, reused), reps)
    lockstep(runs[:1], lambda run: run.time("match full (from_packed key), ours only", run.c.match,
                                            RadixKey.from_packed(packed)), reps)
    lockstep(runs, match("match 32k miss (fresh key)", miss), reps)
    lockstep(runs, match("match 16k fork (fresh key)", fork), reps)
    few = max(reps // 20, 6)
    lockstep(runs, lambda run: (fresh_tree(run), match("match 16k fork, fresh tree (bisect + split)", fork)(run)), few)
    lockstep(runs, fresh_tree)
    for n in (1024, 2048, 4096, 8192, 16384, 32768):
        lockstep(runs, match("match 1k..32k prefixes (fresh key)", seq[:n]), max(reps // 10, 20))
    for run in runs:
        run.notes["match 1k..32k prefixes (fresh key)"] = slope_note(max(reps // 10, 20), run.out["match 1k..32k prefixes (fresh key)"])

    def insert(op: str, ids: array, setup: Callable[[Run], None]) -> Callable[[Run], None]:
        def step(run: Run) -> None:
            setup(run)
            run.time(op, run.c.insert, ids.tolist(), run.c.alloc.alloc(32768))
        return step

    lockstep(runs, insert("insert 32k into an empty tree", seq, lambda run: fresh_tree(run, False)), few)
    lockstep(runs, insert("insert 16k fork of a 32k node (fresh tree)", fork, fresh_tree), few)
    matched_tree = lambda run: (fresh_tree(run), run.c.match(seq.tolist()))  # node compared once: packed
    lockstep(runs, insert("insert 16k fork of a 32k node (matched before)", fork, matched_tree), few)
    lockstep(runs, lambda run: run.time("insert 32k already present", run.c.insert, seq.tolist(),
                                        torch.arange(1, 32769)), reps)
    for run in runs:
        run.c.check()
    return [run.samples() for run in runs]


def slope_note(per_length: int, samples: List[float]) -> str:
    """Least-squares slope of time vs tokens (1k..32k, `per_length` samples each), in us/1k tokens."""
    lengths = np.repeat([1024, 2048, 4096, 8192, 16384, 32768], per_length)
    slope, intercept = np.polyfit(lengths.astype(float), np.asarray(samples), 1)
    return f"slope {slope * 1000:.1f} us/1k tok, intercept {intercept:.1f} us"


def build_tree(impl, page: int, target_tokens: int, seed: int = 3) -> Ours:
    """Groups of 8 sequences (64 shared + 192 own tokens); then 20% of them are re-matched so
    an LRU heap holds stale priorities, as in a live server."""
    rng = random.Random(seed)
    groups = target_tokens // (64 + 8 * 192)
    c = impl(page, groups * (64 + 8 * 192) + 64 * page)
    seqs = [head + rand_tokens(rng, 192) for head in (rand_tokens(rng, 64) for _ in range(groups)) for _ in range(8)]
    for s in seqs:
        slots = c.alloc.alloc(256)
        c.alloc.free(slots[: c.insert(s.tolist(), slots)])
    for s in rng.sample(seqs, len(seqs) // 5):
        c.match(s.tolist())
    return c


def run_evict(impls, page: int, sizes: List[int], calls: int) -> List[Dict[str, Samples]]:
    """The same evict(1000) on trees of different sizes (cost must not grow with the tree),
    then 1% of the tree per call."""
    out: List[Dict[str, Samples]] = [{} for _ in impls]
    for size in sizes:
        runs = [Run(build_tree(impl, page, size)) for impl in impls]
        total = runs[0].c.total_size()
        for amount in [1000] + ([total // 100] if total >= 500_000 else []):
            gc.collect()
            op = f"evict({amount})"
            lockstep(runs, lambda run: setattr(run, "evicted", run.evicted + run.time(op, run.c.evict, amount)), calls)
            for run in runs:
                run.notes[op] = f"{calls} calls in a row, {run.evicted} tokens freed"
                run.evicted = 0
        for res, run in zip(out, runs):
            run.c.check()
            res[f"evict from {total // 1000}k-token tree"] = run.samples()
    return out


def stats(samples: List[float]) -> Tuple[float, float, float]:
    arr = np.asarray(samples)
    return float(np.median(arr)), float(np.percentile(arr, 99)), float(arr.min())


def record(trace: str, page: int, ours: Samples, sgl: Optional[Samples]) -> None:
    for op, (samples, note) in ours.items():
        med, p99, lo = stats(samples) if samples else (0.0, 0.0, 0.0)
        row = [trace, str(page), op, str(len(samples)), f"{med:.1f}", f"{p99:.1f}", f"{lo:.1f}"]
        other = sgl.get(op) if sgl else None
        if other and other[0] and samples:
            s_med, _, s_lo = stats(other[0])
            row += [f"{s_med:.1f}", f"{s_lo:.1f}", f"{s_med / max(med, 1e-9):.2f}x", f"{s_lo / max(lo, 1e-9):.2f}x"]
        else:
            row += ["-", "-", "-", "-"]
        ROWS.append(tuple(row + [note]))


def print_table() -> None:
    header = ("trace", "page", "op", "n", "median us", "p99 us", "min us", "SGL median", "SGL min",
              "speedup med", "speedup min", "notes")
    widths = [max(len(r[i]) for r in ROWS + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in ROWS:
        print(line(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces (smoke run)")
    parser.add_argument("--no-sglang", action="store_true", help="time our cache only")
    parser.add_argument("--pages", default="1,16", help="page sizes to run, comma-separated")
    args = parser.parse_args()
    convs, reps = (40, 100) if args.quick else (200, 1000)
    torch.set_num_threads(1)
    impls = [Ours]
    SGLang.cls = None if args.no_sglang else load_sglang_radix_cache()
    if SGLang.cls is not None:
        impls.append(SGLang)
    pair = lambda res: (res[0], res[1] if len(res) > 1 else None)
    for page in (int(p) for p in args.pages.split(",")):
        record("chat 200x8", page, *pair(run_chat(impls, page, 1 << 22, convs, 8)))
        record("shared prefix 64x16", page, *pair(run_shared_prefix(impls, page, 16 if args.quick else 64)))
        record("chat 200x8, 200k pool", page, *pair(run_chat(impls, page, 200_000 if not args.quick else 40_000, convs, 8)))
        record("32k sequence", page, *pair(run_long(impls, page, reps)))
        ours, sgl = pair(run_evict(impls, page, [100_000, 1_000_000], 10 if args.quick else 20))
        for trace, res in ours.items():
            record(trace, page, res, sgl.get(trace) if sgl else None)
    print_table()


if __name__ == "__main__":
    main()
