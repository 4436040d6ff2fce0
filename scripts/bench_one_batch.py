"""Prefill and decode throughput of one static batch, side by side with HF transformers.

    python scripts/bench_one_batch.py --preset llama-100m
    python scripts/bench_one_batch.py --model-path DIR --batch-sizes 1 8 --input-lens 128
    python scripts/bench_one_batch.py --preset llama-100m --no-hf --decode-modes eager compile
    python scripts/bench_one_batch.py --preset llama-1b --dtype bfloat16 --no-hf --decode-modes eager graph
    python scripts/bench_one_batch.py --no-hf --batch-sizes 16 --input-lens 1100 --decode-attention paged torch
    python scripts/bench_one_batch.py --preset thin-30 --no-hf --batch-sizes 1 16   # fixed cost of a step
    python scripts/bench_one_batch.py --preset thin-30 --no-hf --decode-modes modules eager   # CPU decode runner
    python scripts/bench_one_batch.py --preset thin-30 --no-hf --decode-modes python-layers eager   # its C++ layer loop

`--tp-size N` (no HF) measures decode step time at TP = 1 (this process, all threads) and at TP = N
(N spawned ranks over gloo/NCCL, the threads split between them) on the same weights and prompts,
and the cost of one all-reduce of a decode step's hidden states, so the collective overhead per
step (2 per layer, plus the embedding's and the LM head's gather) is visible.

`--decode-attention paged torch` (CPU) compares decode attention implementations on one prefilled
batch, alternating them step by step so that both see the same lengths and the same machine load:
`paged` (the C++ op reading the KV pool in place, kernels/cpu), `paged-unshared` (the same op
reading a prefix shared by several requests once per request), `paged-fp32-tiles` (the same op
scoring bf16 KV through fp32 copies of the rows, as before its AVX512-BF16 path) and `torch` (the
gather into padded buffers + SDPA fallback). The table gives the median step of each and the ratio to the first.
`--shared-prefix LEN GROUPS` makes the requests of each group share their first LEN slots.

`--decode-modes` measures decode once per mode, side by side on the same runner and inputs:
`eager` (the plain forward), `graph` (the CUDA-graph runner: captured graphs on CUDA, its eager
replay of padded static buffers on CPU, which gathers the full context width and is only a
test path there), `compile` (as --enable-torch-compile: compiled buckets inside the graphs on
CUDA, the dynamic-shape compiled forward on CPU), `modules` (CPU: the module tree's forward, with
the CPU decode runner of `eager` turned off), `python-layers` (CPU: that runner with its layers run
by its Python loop instead of one decode_layers call, kernels/cpu/csrc/decode_layers.cpp). On CUDA the table adds the memory-bandwidth roofline:
weight bytes read per decode step / --peak-bandwidth-tbs, as a fraction of the measured step.

Both runtimes get the same weights (HF's seeded random init, saved and loaded by ours for presets)
and the same inputs; the table prints tokens/s and our/HF ratios measured in one run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from srt.model_executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatch  # noqa: E402
from srt.server_args import ATTENTION_BACKEND_CHOICES, KV_CACHE_DTYPE_CHOICES, ServerArgs  # noqa: E402

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
    # SmolLM2-135M's 30 layers at almost no arithmetic: its decode step is the fixed cost per step
    # (Python, op dispatch, per-call library overhead) that every 30-layer model pays.
    "thin-30": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=30, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, vocab_size=1024),
    "llama-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=4, vocab_size=32000),
    # Llama 3.2 1B's shapes (1.24B parameters, tied embeddings).
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def write_preset(name: str, out: Path, context: int) -> Path:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=context,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg.update(PRESETS[name])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t


def bench_ours(runner: ModelRunner, prompts, out_len: int):
    dev = runner.device
    batch = StaticBatch(runner, len(prompts))
    out, t_prefill = timed(lambda: batch.extend(prompts), dev)
    nxt = out.next_token_logits.argmax(-1)
    steps = []
    for _ in range(out_len - 1):
        out, t = timed(lambda: batch.decode(nxt), dev)
        nxt = out.next_token_logits.argmax(-1)
        steps.append(t)
    batch.release()
    return t_prefill, statistics.median(steps)


@torch.no_grad()
def bench_hf(hf, prompts, out_len: int, device: str):
    ids = torch.tensor(prompts, device=device)
    _, t_prefill = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), device)
    kw = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    _, t_gen = timed(lambda: hf.generate(ids, attention_mask=torch.ones_like(ids), **kw), device)
    per_step = max(t_gen - t_prefill, 1e-9) / (out_len - 1)
    return t_prefill, per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="llama-100m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-lens", type=int, nargs="+", default=[128, 512])
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPE_CHOICES,
                   help="KV storage dtype, as the server flag (auto = the weights' dtype)")
    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES,
                   help="as launch_server's (auto = flashinfer on CUDA when installed)")
    p.add_argument("--decode-modes", nargs="+", choices=["eager", "python-layers", "modules", "graph", "compile"],
                   default=None,
                   help="measure decode in each mode side by side (see the module docstring); no HF")
    p.add_argument("--peak-bandwidth-tbs", type=float, default=4.8, help="memory bandwidth for the roofline (H200: 4.8)")
    p.add_argument("--json-out", help="also write the rows as JSON here")
    p.add_argument("--tp-size", type=int, default=1, help="compare decode at TP = 1 and TP = this (see above)")
    p.add_argument("--decode-attention", nargs="+", default=None,
                   choices=["paged", "paged-unshared", "paged-fp32-tiles", "torch"],
                   help="CPU: compare decode attention implementations step by step (see above); no HF")
    p.add_argument("--random-prompt-kv", action="store_true",
                   help="with --decode-attention: random prompt K/V instead of a prefill (same decode cost)")
    p.add_argument("--shared-prefix", type=int, nargs=2, metavar=("LEN", "GROUPS"),
                   help="with --random-prompt-kv: request i joins group i %% GROUPS, whose requests share their "
                        "first LEN slots (as a radix-cache hit leaves them); paged-unshared reads them per request")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    tmp = tempfile.TemporaryDirectory()
    steps = (args.output_len + 1) * len(args.decode_attention) if args.decode_attention else args.output_len
    max_len = max(args.input_lens) + steps + 8
    hf = None
    hf_side = not (args.no_hf or args.decode_modes or args.decode_attention or args.tp_size > 1)
    if args.model_path:
        path, load_format = args.model_path, "auto"
    else:
        path, load_format = str(write_preset(args.preset, Path(tmp.name), max(4096, max_len))), "dummy"
        if hf_side:  # HF's seeded init, saved and loaded by ours like any checkpoint: same weights
            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
            hf.save_pretrained(path)
            load_format = "auto"
    # Graphs are built per mode below. A compile mode builds the runner as --enable-torch-compile
    # does (CPU linear weights left unpacked: the compiled forward cannot trace oneDNN's opaque
    # packed tensors, it freezes the dense ones), so every mode of the run measures that same model;
    # on CPU the runner compiles the decode forward while it starts.
    compiles = "compile" in (args.decode_modes or [])
    sa = ServerArgs(model_path=path, dtype=args.dtype, device=args.device, load_format=load_format,
                    disable_cuda_graph=True, enable_torch_compile=compiles, attention_backend=args.attention_backend,
                    kv_cache_dtype=args.kv_cache_dtype)
    T = max(args.batch_sizes) * max_len + 64
    t0 = time.perf_counter()
    runner = ModelRunner(sa, max_total_tokens=T, max_running_requests=max(args.batch_sizes))
    print(f"# runner built in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.decode_modes:
        return bench_modes(runner, args, max_len)
    if args.decode_attention:
        return bench_decode_attention(runner, args)
    if args.tp_size > 1:
        del runner
        return bench_tp(args, path, load_format, T)
    if hf_side:
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        hf = hf.to(runner.device).eval()
    vocab = runner.model_config.vocab_size
    name = args.model_path or args.preset
    print(f"# bench_one_batch: {name}, {args.dtype}, {runner.device}, threads={torch.get_num_threads()}, "
          f"output_len={args.output_len}, attention={runner.attention_backend_name}, "
          f"kv={runner.token_to_kv_pool.store_dtype}")
    head = "| batch | input | prefill tok/s | decode tok/s | decode step ms |"
    if hf is not None:
        head += " HF prefill tok/s | HF decode tok/s | prefill x | decode x |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, vocab, (bs, L), generator=g).tolist()
            bench_ours(runner, prompts[:1], 3)  # warm-up
            t_pre, t_step = bench_ours(runner, prompts, args.output_len)
            row = f"| {bs} | {L} | {bs * L / t_pre:,.0f} | {bs / t_step:,.1f} | {t_step * 1e3:.2f} |"
            if hf is not None:
                bench_hf(hf, prompts[:1], 3, runner.device)  # warm-up
                h_pre, h_step = bench_hf(hf, prompts, args.output_len, runner.device)
                row += (f" {bs * L / h_pre:,.0f} | {bs / h_step:,.1f} | {h_pre / t_pre:.2f} | "
                        f"{h_step / t_step:.2f} |")
            print(row, flush=True)


def _tp_rank_main(rank: int, tp: int, port: int, args, path: str, load_format: str, T: int, queue) -> None:
    """One TP rank: the same decode benchmark as TP = 1, rank 0 reports."""
    import torch.distributed as dist

    torch.set_num_threads(max(1, (args.threads or torch.get_num_threads()) // tp))
    sa = ServerArgs(model_path=path, dtype=args.dtype, device=args.device, disable_cuda_graph=True, tp_size=tp)
    runner = ModelRunner(sa, max_total_tokens=T, max_running_requests=max(args.batch_sizes), tp_rank=rank,
                         dist_init_method=f"tcp://127.0.0.1:{port}")
    rows = []
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, runner.model_config.vocab_size, (bs, L), generator=g).tolist()
            bench_ours(runner, prompts, 3)
            _, t_step = bench_ours(runner, prompts, args.output_len)
            x = torch.randn(bs, runner.model_config.hidden_size, dtype=runner.dtype, device=runner.device)
            for _ in range(3):
                dist.all_reduce(x)
            n = 50
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            sync(runner.device)
            rows.append((bs, L, t_step, (time.perf_counter() - t0) / n))
    if rank == 0:
        queue.put(rows)
    dist.barrier()


def bench_tp(args, path: str, load_format: str, T: int) -> None:
    """Decode step time at TP = 1 and TP = args.tp_size on the same saved weights."""
    import multiprocessing as mp
    import socket

    if load_format == "dummy":  # every rank must load the same weights: save HF's seeded init once
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=getattr(torch, args.dtype))
        hf.save_pretrained(path)
        del hf
    sa = ServerArgs(model_path=path, dtype=args.dtype, device=args.device, disable_cuda_graph=True)
    runner = ModelRunner(sa, max_total_tokens=T, max_running_requests=max(args.batch_sizes))
    base = {}
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, runner.model_config.vocab_size, (bs, L), generator=g).tolist()
            bench_ours(runner, prompts, 3)
            base[(bs, L)] = bench_ours(runner, prompts, args.output_len)[1]
    layers = runner.model_config.num_hidden_layers
    del runner
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank_main, args=(r, args.tp_size, port, args, path, load_format, T, queue))
             for r in range(args.tp_size)]
    for proc in procs:
        proc.start()
    rows = queue.get(timeout=3600)
    for proc in procs:
        proc.join(60)
    tp = args.tp_size
    print(f"# bench_one_batch --tp-size {tp}: {args.model_path or args.preset}, {args.dtype}, {args.device}, "
          f"threads={args.threads or torch.get_num_threads()} in total, output_len={args.output_len}, "
          f"{2 * layers + 1} all-reduces + 1 all-gather + 1 broadcast per decode step")
    print(f"| batch | input | TP=1 step ms | TP={tp} step ms | TP={tp} / TP=1 | one all-reduce ms | "
          f"all-reduces per step ms |")
    print("|---|---|---|---|---|---|---|")
    for bs, L, t_step, t_ar in rows:
        print(f"| {bs} | {L} | {base[(bs, L)] * 1e3:.2f} | {t_step * 1e3:.2f} | {t_step / base[(bs, L)]:.2f} | "
              f"{t_ar * 1e3:.3f} | {(2 * layers + 1) * t_ar * 1e3:.2f} |", flush=True)


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes a decode step reads at least once: every parameter (a tied LM head counts once)."""
    seen = {}
    for p in runner.model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def bench_modes(runner: ModelRunner, args, max_len: int) -> None:
    """Decode step time per mode on the same runner and prompts; ratios against `eager`."""
    vocab, dev = runner.model_config.vocab_size, runner.device
    on_cuda = dev.startswith("cuda")
    wbytes = weight_bytes(runner)
    capture = sorted(set(args.batch_sizes))
    runners = {}
    compiled, flat = None, runner.cpu_decode_runner
    for mode in args.decode_modes:
        t0 = time.perf_counter()
        if mode in ("eager", "python-layers", "modules") or (mode == "compile" and not on_cuda):
            runners[mode] = None
            if mode == "compile":  # built with the runner, as at server start-up
                if runner.compiled_forward is None:
                    runner.init_torch_compile()
                compiled, runner.compiled_forward = runner.compiled_forward, None
        else:
            runners[mode] = CudaGraphRunner(runner, capture_bs=capture, use_cuda_graph=on_cuda,
                                            enable_torch_compile=mode == "compile")
        print(f"# {mode}: set up in {time.perf_counter() - t0:.1f} s", flush=True)
    unpacked = ""
    if "compile" in args.decode_modes and not on_cuda:
        unpacked = (", CPU weights unpacked as under --enable-torch-compile (the compiled decode runs on "
                    "inductor's frozen, packed copies)")
    print(f"# bench_one_batch --decode-modes: {args.model_path or args.preset}, {args.dtype}, {dev}, "
          f"threads={torch.get_num_threads()}, output_len={args.output_len}, attention={runner.attention_backend_name}, "
          f"weights {wbytes / 1e9:.3f} GB{unpacked}")
    head = "| batch | input | mode | prefill tok/s | decode tok/s | decode step ms | x eager |"
    if on_cuda:
        head += " roofline ms | % of roofline |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = []
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, vocab, (bs, L), generator=g).tolist()
            times = {}
            for mode in args.decode_modes:
                runner.graph_runner = runners[mode]
                runner.compiled_forward = compiled if mode == "compile" else None
                runner.cpu_decode_runner = None if mode == "modules" else flat
                if flat is not None:
                    flat.use_layer_op = mode != "python-layers" and flat.why_no_layer_op is None
                bench_ours(runner, prompts, 3)  # warm-up (and the first compile of this size)
                times[mode] = bench_ours(runner, prompts, args.output_len)
            base = times.get("eager", times[args.decode_modes[0]])[1]
            for mode, (t_pre, t_step) in times.items():
                row = dict(batch=bs, input=L, mode=mode, prefill_tok_s=bs * L / t_pre, decode_tok_s=bs / t_step,
                           step_ms=t_step * 1e3, x_eager=base / t_step)
                line = (f"| {bs} | {L} | {mode} | {row['prefill_tok_s']:,.0f} | {row['decode_tok_s']:,.1f} | "
                        f"{row['step_ms']:.2f} | {row['x_eager']:.2f} |")
                if on_cuda:
                    roof = wbytes / (args.peak_bandwidth_tbs * 1e12)
                    row.update(roofline_ms=roof * 1e3, roofline_fraction=roof / t_step)
                    line += f" {roof * 1e3:.3f} | {100 * roof / t_step:.0f}% |"
                rows.append(row)
                print(line, flush=True)
    runner.graph_runner = runner.compiled_forward = None
    runner.cpu_decode_runner = flat
    if flat is not None:
        flat.use_layer_op = flat.why_no_layer_op is None
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))


def fill_prompt_kv(batch: StaticBatch, length: int, seed: int = 0, shared: int = 0, groups: int = 0) -> None:
    """What a prefill of `length` tokens per request leaves behind (slots, `req_to_token`, K/V),
    with random K/V: decode attention costs the same, and a prefill of 16 x 1,100 tokens costs
    minutes of CPU. With `groups`, request i joins group i % groups, and the group's members after
    the first hold its first `shared` slots, as requests matching one cached prefix do."""
    runner, n = batch.runner, len(batch.rows)
    leads = range(min(n, groups)) if groups else range(n)
    members = [i for i in range(n) if i not in leads]
    own = [length] * len(leads) + [length - shared] * len(members)
    slots = runner.token_to_kv_pool_allocator.alloc_extend([0] * n, own, batch._last_locs(range(n)))
    if slots is None:
        raise RuntimeError("KV pool exhausted")
    off = 0
    for i, count in zip([*leads, *members], own):
        mine = slots[off : off + count]
        off += count
        if count < length:
            lead_row = batch.rows[i % groups]
            mine = torch.cat([runner.req_to_token_pool.req_to_token[lead_row, :shared].to(mine), mine])
        runner.req_to_token_pool.write(batch.rows[i], 0, mine)
        batch.seq_lens[i] = length
    batch.shared_members, batch.shared_len = members, shared
    pool, g = runner.token_to_kv_pool, torch.Generator().manual_seed(seed)
    for buf in pool.k_buffer + pool.v_buffer:
        rows = torch.randn((len(slots),) + tuple(buf.shape[1:]), generator=g).to(buf.dtype)
        buf.index_copy_(0, slots.to(buf.device), rows.to(buf.device))


def release_shared(batch: StaticBatch) -> None:
    """Free a batch from fill_prompt_kv: the shared prefixes once, through their group's lead."""
    table = batch.runner.req_to_token_pool.req_to_token
    for i in getattr(batch, "shared_members", []):
        batch.runner.token_to_kv_pool_allocator.free(table[batch.rows[i], batch.shared_len : batch.seq_lens[i]].long())
        batch.seq_lens[i] = 0
    batch.release()


def bench_decode_attention(runner: ModelRunner, args) -> None:
    """Median decode step per attention implementation, alternating them step by step on one batch:
    wall time and this process's CPU time (less disturbed by other load on the machine)."""
    from kernels.attention.torch_native_backend import TorchNativeAttnBackend

    pool = runner.token_to_kv_pool
    backends = {"paged": TorchNativeAttnBackend(runner.device, pool.dtype, pool.store_dtype),
                "paged-unshared": TorchNativeAttnBackend(runner.device, pool.dtype, pool.store_dtype),
                "torch": TorchNativeAttnBackend(runner.device)}
    if backends["paged"].paged_decode is None:
        sys.exit("the C++ paged decode op is unavailable here (CUDA device, fp8/fp16 KV, or no build): see the log")
    backends["paged-unshared"].paged_decode = functools.partial(backends["paged"].paged_decode, share_prefixes=False)
    backends["paged-fp32-tiles"] = TorchNativeAttnBackend(runner.device, pool.dtype, pool.store_dtype)
    backends["paged-fp32-tiles"].paged_decode = functools.partial(backends["paged"].paged_decode, bf16_dot=False)
    impls = args.decode_attention
    shared, groups = args.shared_prefix or (0, 0)
    if groups and not args.random_prompt_kv:
        sys.exit("--shared-prefix needs --random-prompt-kv")
    print(f"# bench_one_batch --decode-attention: {args.model_path or args.preset}, {args.dtype}, "
          f"KV {str(pool.store_dtype).replace('torch.', '')}, {runner.device}, threads={torch.get_num_threads()}, "
          f"{args.output_len} decode steps per implementation, prompt KV "
          f"{'random' if args.random_prompt_kv else 'prefilled'}"
          + (f", {groups} groups sharing their first {shared} slots" if groups else ""))
    head = "| batch | input | " + " | ".join(f"{i} step ms | {i} CPU ms" for i in impls)
    both = impls[0] != "torch" and "torch" in impls
    head += f" | torch / {impls[0]} (wall) | torch / {impls[0]} (CPU) |" if both else " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    g = torch.Generator().manual_seed(0)
    for L in args.input_lens:
        for bs in args.batch_sizes:
            prompts = torch.randint(3, runner.model_config.vocab_size, (bs, L), generator=g).tolist()
            free_before = runner.token_to_kv_pool_allocator.available_size()
            batch = StaticBatch(runner, bs)
            if args.random_prompt_kv:
                fill_prompt_kv(batch, L, shared=shared, groups=groups)
                nxt = torch.tensor([p[-1] for p in prompts], device=runner.device)
            else:
                nxt = batch.extend(prompts).next_token_logits.argmax(-1)
            wall, cpu = {i: [] for i in impls}, {i: [] for i in impls}
            for step in range(len(impls) * (args.output_len + 1)):
                impl = impls[step % len(impls)]
                runner.attn_backend = backends[impl]
                c0 = time.process_time()
                out, t = timed(lambda: batch.decode(nxt), runner.device)
                nxt = out.next_token_logits.argmax(-1)
                if step >= len(impls):  # the first step of each is a warm-up
                    wall[impl].append(t)
                    cpu[impl].append(time.process_time() - c0)
            release_shared(batch)
            free_after = runner.token_to_kv_pool_allocator.available_size()
            if free_after != free_before:
                raise RuntimeError(f"KV slots leaked or freed twice: {free_before} free before, {free_after} after")
            w = {i: statistics.median(ts) for i, ts in wall.items()}
            c = {i: statistics.median(ts) for i, ts in cpu.items()}
            row = f"| {bs} | {L} | " + " | ".join(f"{w[i] * 1e3:.1f} | {c[i] * 1e3:.1f}" for i in impls)
            base = impls[0]
            row += f" | {w['torch'] / w[base]:.2f} | {c['torch'] / c[base]:.2f} |" if both else " |"
            print(row, flush=True)
    runner.attn_backend = backends["paged"]


if __name__ == "__main__":
    main()
