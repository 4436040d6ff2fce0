"""CPU linear layouts side by side: oneDNN's packed weights against kernels/cpu/gemm.py's panels,
its fp32 dense-weight dot kernel (AVX-512) and, on a CPU with AMX, its bf16 tile kernel.

    python scripts/bench_cpu_gemm.py --model-path .tiny_models/smollm2-135m-instruct-*   # both tables
    python scripts/bench_cpu_gemm.py --model-path DIR --skip-model --rows 1 16 64

Table 1 (ops): every layer's matmuls of the model's shapes, each layer with weights of its own
(so, as in a real decode step, the weights stream from memory rather than sit in cache), at each
row count: oneDNN (fp32 weights; how bf16 runs on a CPU without bf16 matmul kernels), panels
with fp32 weights, panels with bf16 weights, the fp32 weights as loaded (`dense`: the dot kernel up
to DENSE_KERNEL_ROWS rows, BLAS above; where the build has AVX-512), and with AMX tiles oneDNN bf16
against the tile kernel (bf16 inputs). Milliseconds per pass over all layers (median of --reps) and GFLOP/s.

Table 2 (model): one ModelRunner per `SRT_CPU_GEMM` layout on the same checkpoint, measured in
turns on the same prompts (so every layout sees the same machine load): prefill tok/s of a
--batch x --input-len extend and the median decode step after it, per dtype (`amx` for bf16
where the CPU has the tiles, `dense` for fp32 where the build has AVX-512).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernels.cpu.gemm import amx_fits, load_amx_ops, load_dense_ops, load_gemm_ops  # noqa: E402
from srt.layers.cpu_weight_packing import dense_linear  # noqa: E402
from srt.model_executor.model_runner import ModelRunner  # noqa: E402
from srt.model_executor.static_batch import StaticBatch  # noqa: E402
from srt.server_args import ServerArgs  # noqa: E402


def layer_shapes(config: dict) -> List[tuple]:
    """(in, out) of one decoder layer's matmuls: fused QKV, O, fused gate/up, down."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    return [(h, (heads + 2 * kv) * d), (heads * d, h), (h, 2 * inter), (inter, h)]


def median_time(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_ops(config: dict, rows_list: List[int], reps: int) -> None:
    shapes, layers = layer_shapes(config), config["num_hidden_layers"]
    g = torch.Generator().manual_seed(0)
    dense = [[torch.randn(n, k, generator=g) * 0.05 for k, n in shapes] for _ in range(layers)]
    layouts: Dict[str, list] = {
        "oneDNN fp32": [[torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws] for ws in dense],
        "panels fp32": [[torch.ops.srt_cpu.convert_weight_packed(w) for w in ws] for ws in dense],
        "panels bf16": [[torch.ops.srt_cpu.convert_weight_packed(w.bfloat16()) for w in ws] for ws in dense],
    }
    has_dense = load_dense_ops()
    if has_dense:  # the weights as loaded: the dot kernel up to DENSE_KERNEL_ROWS rows, BLAS above
        layouts["dense fp32"] = dense
    amx = load_amx_ops() and all(amx_fits(w) for w in dense[0])
    if amx:
        layouts["oneDNN bf16"] = [[torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in ws] for ws in dense]
        layouts["AMX bf16"] = [[torch.ops.srt_cpu.convert_weight_amx(w.bfloat16()) for w in ws] for ws in dense]

    def run(name: str, weights: list, xs: dict) -> None:
        inputs = {k: x.bfloat16() for k, x in xs.items()} if name.endswith("bf16") and "panels" not in name else xs
        for ws in weights:
            for (k, n), w in zip(shapes, ws):
                if name.startswith("oneDNN"):
                    torch.ops.mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")
                elif name.startswith("AMX"):
                    torch.ops.srt_cpu.amx_linear(inputs[k], w, None, None)
                elif name.startswith("dense"):
                    dense_linear(xs[k], w)
                else:
                    torch.ops.srt_cpu.weight_packed_linear(xs[k], w, None, n, None)

    print(f"\n{layers} layers x {len(shapes)} matmuls {shapes}, weights streamed from memory, "
          f"threads={torch.get_num_threads()}\n")
    head = "| rows | " + " | ".join(f"{name} ms" for name in layouts) + " | panels fp32 x | panels bf16 x |"
    head += " dense fp32 x |" if has_dense else ""
    head += " AMX vs oneDNN bf16 x |" if amx else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    flops_per_row = 2 * layers * sum(k * n for k, n in shapes)
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g) for k in {k for k, _ in shapes}}
        ms = {name: median_time(lambda: run(name, w, xs), reps) * 1e3 for name, w in layouts.items()}
        base = ms["oneDNN fp32"]
        cells = " | ".join(f"{v:.1f} ({rows * flops_per_row / v / 1e6:.0f} GF/s)" for v in ms.values())
        line = f"| {rows} | {cells} | {base / ms['panels fp32']:.2f} | {base / ms['panels bf16']:.2f} |"
        line += f" {base / ms['dense fp32']:.2f} |" if has_dense else ""
        line += f" {ms['oneDNN bf16'] / ms['AMX bf16']:.2f} |" if amx else ""
        print(line, flush=True)


def bench_model(path: str, dtype: str, batch: int, input_len: int, steps: int, rounds: int) -> None:
    runners = {}
    saved = os.environ.get("SRT_CPU_GEMM")
    try:
        layouts = ("onednn", "srt") + (("amx",) if dtype == "bfloat16" and load_amx_ops() else ())
        layouts += ("dense",) if dtype == "float32" and load_dense_ops() else ()
        for layout in layouts:
            os.environ["SRT_CPU_GEMM"] = layout
            args = ServerArgs(model_path=path, dtype=dtype, disable_cuda_graph=True)
            runners[layout] = ModelRunner(args, max_total_tokens=batch * (input_len + steps + 8) + 64,
                                          max_running_requests=batch)
    finally:
        if saved is None:
            os.environ.pop("SRT_CPU_GEMM", None)
        else:
            os.environ["SRT_CPU_GEMM"] = saved
    vocab = runners["onednn"].model_config.vocab_size
    prompts = torch.randint(3, vocab, (batch, input_len), generator=torch.Generator().manual_seed(1)).tolist()
    prefill: Dict[str, List[float]] = {name: [] for name in runners}
    decode: Dict[str, List[float]] = {name: [] for name in runners}
    for r in range(rounds + 1):  # round 0 warms up
        for name, runner in runners.items():
            b = StaticBatch(runner, batch)
            start = time.perf_counter()
            out = b.extend(prompts)
            t_prefill = time.perf_counter() - start
            nxt, t_steps = out.next_token_logits.argmax(-1), []
            for _ in range(steps):
                start = time.perf_counter()
                out = b.decode(nxt)
                t_steps.append(time.perf_counter() - start)
                nxt = out.next_token_logits.argmax(-1)
            b.release()
            if r:
                prefill[name].append(t_prefill)
                decode[name].extend(t_steps)
    for name in runners:
        pre, step = statistics.median(prefill[name]), statistics.median(decode[name])
        base_pre, base_step = statistics.median(prefill["onednn"]), statistics.median(decode["onednn"])
        print(f"| {dtype} | {name} | {batch * input_len / pre:,.0f} | {step * 1e3:.1f} | "
              f"{base_pre / pre:.2f} | {base_step / step:.2f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="a Hugging Face folder (its config.json gives the shapes)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--skip-ops", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="decode steps after each prefill")
    p.add_argument("--rounds", type=int, default=5, help="measured turns per layout (after one warm-up)")
    args = p.parse_args()
    if not load_gemm_ops():
        sys.exit("The C++ CPU kernels do not build here (see kernels/cpu/build.py); nothing to compare.")
    config = json.loads((Path(args.model_path) / "config.json").read_text())
    print(f"# bench_cpu_gemm: {args.model_path}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if not args.skip_ops:
        bench_ops(config, args.rows, args.reps)
    if not args.skip_model:
        print(f"\nModel: batch {args.batch} x {args.input_len}, {args.steps} decode steps, {args.rounds} turns per "
              f"layout; x = oneDNN time / this layout's time\n")
        print("| dtype | SRT_CPU_GEMM | prefill tok/s | decode step ms | prefill x | decode x |")
        print("|---|---|---|---|---|---|")
        for dtype in args.dtypes:
            bench_model(args.model_path, dtype, args.batch, args.input_len, args.steps, args.rounds)


if __name__ == "__main__":
    main()
