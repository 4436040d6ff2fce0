"""CPU extend attention: the C++ op reading the KV pool in place against the torch path (per-request
gather + masked SDPA), one layer, side by side in turns on the same pool, printed as a table.

    python scripts/bench_cpu_attention.py                        # the default shapes, fp32 and bf16
    python scripts/bench_cpu_attention.py --heads 4 2 --cases 15x64@1024 1x1024@0 --dtypes fp32

A case `BxE@P` is B requests of E new tokens over a cached prefix of P tokens each (slots
shuffled, as an allocator that has been running a while hands them out). GFLOP/s counts the
QK and PV products that causal attention needs, the same for both.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernels.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402

logger = logging.getLogger("bench_cpu_attention")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_case(text: str):
    shape, prefix = text.split("@")
    bs, ext = shape.split("x")
    return int(bs), int(ext), int(prefix)


def make_batch(bs, ext, prefix, heads, kv_heads, dim, dtype, backend, seed=0):
    """A pool holding every request's prefix and new tokens in shuffled slots, and the step's batch."""
    g = torch.Generator().manual_seed(seed)
    total = bs * (prefix + ext)
    pool = MHATokenToKVPool(total + 1, 1, dtype, dtype, kv_heads, dim, 1)
    pool.k_buffer[0].copy_(torch.randn(pool.k_buffer[0].shape, generator=g).to(dtype))
    pool.v_buffer[0].copy_(torch.randn(pool.v_buffer[0].shape, generator=g).to(dtype))
    slots = (torch.randperm(total, generator=g) + 1).int().view(bs, prefix + ext)
    req_pool = ReqToTokenPool(bs, prefix + ext)
    rows = req_pool.alloc(bs)
    for i, row in enumerate(rows):
        req_pool.req_to_token[row, : prefix + ext] = slots[i]
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req_pool, token_to_kv_pool=pool, attn_backend=backend)
    loc = slots[:, prefix:].flatten().long()
    fb = ForwardBatch.create_extend(runner, [[0] * ext] * bs, [prefix] * bs, rows, loc)
    q = torch.randn(bs * ext, heads * dim, generator=g).to(dtype)
    return fb, q


def time_backends(backends, case, heads, kv_heads, dim, dtype, reps):
    bs, ext, prefix = case
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=heads, tp_k_head_num=kv_heads, head_dim=dim, scaling=dim**-0.5)
    batches = {name: make_batch(bs, ext, prefix, heads, kv_heads, dim, dtype, b) for name, b in backends.items()}
    outs, times = {}, {name: [] for name in backends}
    for rep in range(reps + 1):
        for name, backend in backends.items():  # in turns: both see the same machine load
            fb, q = batches[name]
            t0 = time.perf_counter()
            backend.init_forward_metadata(fb)
            outs[name] = backend.forward_extend(q, layer, fb)
            if rep:
                times[name].append(time.perf_counter() - t0)
    diff = (outs["op"].float() - outs["torch"].float()).abs().max().item()
    flops = 4 * bs * heads * dim * ext * (prefix + (ext + 1) / 2)
    return {name: statistics.median(ts) for name, ts in times.items()}, flops, diff


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("Q", "KV"))
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cases", nargs="+", default=["15x64@1024", "1x1024@0", "1x1024@1024", "16x256@0"])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads, kv_heads = args.heads
    print(f"# bench_cpu_attention: extend, heads {heads}/{kv_heads}, head_dim {args.head_dim}, "
          f"threads {torch.get_num_threads()}, median of {args.reps}")
    print("| dtype | case (B x E @ prefix) | torch path ms | op ms | torch GFLOP/s | op GFLOP/s | torch / op | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        backends = {"torch": TorchNativeAttnBackend(), "op": TorchNativeAttnBackend("cpu", dtype, dtype)}
        if backends["op"].paged_extend is None:
            sys.exit("the C++ extend op is unavailable here (no build): see the warning logged above")
        for text in args.cases:
            t, flops, diff = time_backends(backends, parse_case(text), heads, kv_heads, args.head_dim, dtype, args.reps)
            print(f"| {dname} | {text} | {t['torch'] * 1e3:.2f} | {t['op'] * 1e3:.2f} | {flops / t['torch'] / 1e9:.0f} | "
                  f"{flops / t['op'] / 1e9:.0f} | {t['torch'] / t['op']:.2f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
