"""Benchmark the radix prefix cache on deterministic traces (not a test).

Traces (page sizes 1 and 16): multi-turn chat (200 conversations x 8 turns, vocab 32000,
50-200 user + 100-400 reply tokens per turn); shared prefix (64 groups x 16 prompts of
2048 + 128 tokens); the chat trace again under a 200k-token pool with eviction; one 32k-token
sequence matched 1000 times fully and to a 16k fork; evicting 1% of a 1M-token tree.
Prints microseconds per match / insert / evict (median, p99, and min, which is the best guide
when other processes share the CPU) and per-token slopes.

Token lists handed to the cache are fresh Python ints (as from a tokenizer), and every match
builds a fresh `RadixKey` (so packing the ids is inside the timing) unless a row says "reused key".

Usage: PYTHONPATH=. python scripts/bench_radix_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from array import array
from typing import Dict, List, Tuple

import numpy as np
import torch

from mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from mem_cache.radix_cache import RadixCache, RadixKey

VOCAB = 32000
ROWS: List[Tuple[str, ...]] = []


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0


def record(trace: str, page: int, op: str, samples: List[float], note: str = "") -> None:
    if not samples:
        ROWS.append((trace, str(page), op, "0", "-", "-", "-", note))
        return
    arr = np.asarray(samples)
    ROWS.append((trace, str(page), op, str(len(arr)), f"{np.median(arr):.1f}", f"{np.percentile(arr, 99):.1f}",
                 f"{arr.min():.1f}", note))


def slope_note(lengths: List[int], samples: List[float]) -> str:
    """Least-squares slope of time vs tokens, in microseconds per 1k tokens."""
    if len(set(lengths)) < 2:
        return ""
    slope, intercept = np.polyfit(np.asarray(lengths, dtype=float), np.asarray(samples), 1)
    return f"slope {slope * 1000:.1f} us/1k tok, intercept {intercept:.1f} us"


def make_cache(page: int, pool_tokens: int) -> RadixCache:
    alloc = TokenToKVPoolAllocator(pool_tokens) if page == 1 else PagedTokenToKVPoolAllocator(pool_tokens, page)
    return RadixCache(None, alloc, page_size=page)


def rand_tokens(rng: random.Random, n: int) -> array:
    return array("i", (rng.randrange(VOCAB) for _ in range(n)))


class Stats:
    def __init__(self) -> None:
        self.match: List[float] = []
        self.match_len: List[int] = []
        self.insert: List[float] = []
        self.insert_len: List[int] = []
        self.evict: List[float] = []
        self.evicted = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0


def serve(cache: RadixCache, prompt: List[int], reply: List[int], st: Stats) -> None:
    """One request's cache traffic: match (L-1 cap), lock, allocate (evicting if short),
    insert prompt + reply up to the committed length, free duplicates and tail, unlock."""
    alloc, P = cache.token_to_kv_pool_allocator, cache.page_size
    key = RadixKey(prompt[: len(prompt) - 1])
    t0 = now_us()
    match = cache.match_prefix(key)
    st.match.append(now_us() - t0)
    st.match_len.append(len(key))
    cached = len(match.device_indices)
    st.prompt_tokens += len(prompt)
    st.cached_tokens += cached
    cache.inc_lock_ref(match.last_node)
    full = prompt + reply
    committed = len(full) - 1 if reply else len(full)
    need = -(-(committed - cached) // P) * P
    if alloc.available_size() < need:
        t0 = now_us()
        st.evicted += cache.evict(need - alloc.available_size())
        st.evict.append(now_us() - t0)
    fresh = alloc.alloc(need)
    if fresh is None:
        raise RuntimeError("pool too small for one request even after eviction")
    value = torch.cat((match.device_indices, fresh[: committed - cached]))
    ins_key = RadixKey(full[:committed])
    t0 = now_us()
    present = cache.insert(ins_key, value)
    st.insert.append(now_us() - t0)
    st.insert_len.append(committed)
    aligned = committed - committed % P
    alloc.free(torch.cat((value[cached:present], value[aligned:])))
    cache.dec_lock_ref(match.last_node)


def chat_trace(convs: int, turns: int, seed: int = 0) -> List[Tuple[int, array, array]]:
    """Turn t of every conversation, then turn t+1: (conversation, user tokens, reply tokens)."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        for c in range(convs):
            out.append((c, rand_tokens(rng, rng.randint(50, 200)), rand_tokens(rng, rng.randint(100, 400))))
    return out


def run_chat(trace_name: str, page: int, pool_tokens: int, convs: int, turns: int) -> None:
    cache, st = make_cache(page, pool_tokens), Stats()
    history: Dict[int, array] = {}
    gc.collect()
    for conv, user, reply in chat_trace(convs, turns):
        hist = history.setdefault(conv, array("i"))
        prompt = (hist + user).tolist()  # fresh int objects, like a re-tokenized history
        serve(cache, prompt, reply.tolist(), st)
        hist.extend(user)
        hist.extend(reply)
    hit = 100.0 * st.cached_tokens / max(st.prompt_tokens, 1)
    record(trace_name, page, "match", st.match, f"hit rate {hit:.1f}%; " + slope_note(st.match_len, st.match))
    record(trace_name, page, "insert", st.insert, slope_note(st.insert_len, st.insert))
    if st.evict:
        record(trace_name, page, "evict", st.evict, f"{st.evicted} tokens in {len(st.evict)} calls")
    cache.check_invariants()


def run_shared_prefix(page: int, groups: int = 64, per_group: int = 16) -> None:
    rng = random.Random(1)
    prefixes = [rand_tokens(rng, 2048) for _ in range(groups)]
    order = [(g, i) for i in range(per_group) for g in range(groups)]
    rng.shuffle(order)
    cache, st = make_cache(page, 1 << 22), Stats()
    gc.collect()
    for g, _ in order:
        prompt = (prefixes[g] + rand_tokens(rng, 128)).tolist()
        serve(cache, prompt, [], st)
    hit = 100.0 * st.cached_tokens / st.prompt_tokens
    record("shared prefix 64x16", page, "match", st.match, f"hit rate {hit:.1f}%")
    record("shared prefix 64x16", page, "insert", st.insert, "")
    cache.check_invariants()


def time_matches(cache: RadixCache, make_key, reps: int) -> Tuple[List[float], int]:
    samples, got = [], 0
    for _ in range(reps):
        key = make_key()
        t0 = now_us()
        got = len(cache.match_prefix(key).device_indices)
        samples.append(now_us() - t0)
    return samples, got


def run_long(page: int, reps: int) -> None:
    rng = random.Random(2)
    seq = rand_tokens(rng, 32768)
    fork = seq[:16384] + rand_tokens(rng, 16384)
    fork[16384] = (seq[16384] + 1) % VOCAB  # diverge exactly at 16k
    cache = make_cache(page, 1 << 17)
    cache.insert(RadixKey(seq.tolist()), cache.token_to_kv_pool_allocator.alloc(32768))
    gc.collect()
    full, got = time_matches(cache, lambda: RadixKey(seq.tolist()), reps)
    record("32k sequence", page, "match full (fresh key)", full, f"matched {got}")
    reused = RadixKey(seq.tolist())
    full_r, got = time_matches(cache, lambda: reused, reps)
    record("32k sequence", page, "match full (reused key)", full_r, f"matched {got}")
    packed = seq.tobytes()
    full_p, got = time_matches(cache, lambda: RadixKey.from_packed(packed), reps)
    record("32k sequence", page, "match full (from_packed key)", full_p, f"matched {got}; ids shipped as int32 bytes")
    miss = array("i", [(seq[0] + 1) % VOCAB]) + seq[1:]
    missed, got = time_matches(cache, lambda: RadixKey(miss.tolist()), reps)
    record("32k sequence", page, "match 32k miss (fresh key)", missed, f"matched {got}; packs only the first 64 ids")
    forked, got = time_matches(cache, lambda: RadixKey(fork.tolist()), reps)
    record("32k sequence", page, "match 16k fork (fresh key)", forked, f"matched {got}; first call split the node")
    splits = []
    for _ in range(max(reps // 20, 5)):
        c = make_cache(page, 1 << 17)
        c.insert(RadixKey(seq.tolist()), c.token_to_kv_pool_allocator.alloc(32768))
        key = RadixKey(fork.tolist())
        t0 = now_us()
        c.match_prefix(key)
        splits.append(now_us() - t0)
    record("32k sequence", page, "match 16k fork, bisect + split", splits, "fresh tree each time")
    for label, make in (("fresh key", lambda n: RadixKey(seq[:n].tolist())),
                        ("from_packed", lambda n: RadixKey.from_packed(packed[: 4 * n]))):
        lengths, samples = [], []
        for n in (1024, 2048, 4096, 8192, 16384, 32768):
            s, _ = time_matches(cache, lambda: make(n), max(reps // 10, 20))
            lengths += [n] * len(s)
            samples += s
        record("32k sequence", page, f"match 1k..32k prefixes ({label})", samples, slope_note(lengths, samples))


def build_tree(page: int, target_tokens: int, seed: int = 3) -> RadixCache:
    """Groups of 8 sequences (64 shared + 192 own tokens); then 20% of them are re-matched so
    the heap holds stale priorities, as in a live server."""
    rng = random.Random(seed)
    groups = target_tokens // (64 + 8 * 192)
    cache = make_cache(page, groups * (64 + 8 * 192) + 64 * page)
    seqs = []
    for _ in range(groups):
        head = rand_tokens(rng, 64)
        for _ in range(8):
            seqs.append(head + rand_tokens(rng, 192))
    alloc = cache.token_to_kv_pool_allocator
    for s in seqs:
        slots = alloc.alloc(256)
        present = cache.insert(RadixKey(s.tolist()), slots)
        alloc.free(slots[:present])
    for s in rng.sample(seqs, len(seqs) // 5):
        cache.match_prefix(RadixKey(s.tolist()))
    return cache


def run_evict(page: int, sizes: List[int], calls: int) -> None:
    """The same evict(1000) on trees of different sizes (cost must not grow with the tree),
    then 1% of the tree per call."""
    for size in sizes:
        cache = build_tree(page, size)
        total = cache.total_size()
        for amount in [1000] + ([total // 100] if total >= 500_000 else []):
            gc.collect()
            samples = []
            for _ in range(calls):
                t0 = now_us()
                cache.evict(amount)
                samples.append(now_us() - t0)
            note = f"{calls} calls in a row; tree had {total} tokens"
            record(f"evict from {total // 1000}k-token tree", page, f"evict({amount})", samples, note)
        cache.check_invariants()


def python_loop_baseline(reps: int) -> None:
    """For scale: a token-by-token Python compare and a list-slice compare of 32k fresh ints."""
    rng = random.Random(4)
    seq = rand_tokens(rng, 32768)
    a = seq.tolist()
    loop, sliced = [], []
    for _ in range(reps):
        b = seq.tolist()
        t0 = now_us()
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        loop.append(now_us() - t0)
        t0 = now_us()
        _ = a[:32768] == b[:32768]
        sliced.append(now_us() - t0)
    record("baseline (not the cache)", 1, "32k compare, Python loop", loop, "what the issue calls >1 ms")
    record("baseline (not the cache)", 1, "32k compare, list slices ==", sliced, "")


def print_table() -> None:
    header = ("trace", "page", "op", "n", "median us", "p99 us", "min us", "notes")
    widths = [max(len(r[i]) for r in ROWS + [header]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in ROWS:
        print(line(r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller traces (smoke run)")
    args = parser.parse_args()
    convs, reps = (40, 100) if args.quick else (200, 1000)
    torch.set_num_threads(1)
    for page in (1, 16):
        run_chat("chat 200x8", page, 1 << 22, convs, 8)
        run_shared_prefix(page, groups=16 if args.quick else 64)
        run_chat("chat 200x8, 200k pool", page, 200_000, convs, 8)
        run_long(page, reps)
        run_evict(page, [100_000, 1_000_000], calls=10 if args.quick else 20)
    python_loop_baseline(max(reps // 10, 20))
    print_table()


if __name__ == "__main__":
    main()
