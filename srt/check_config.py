"""`python -m srt.check_config` (also `launch_server --dry-run`): the server's start-up checks and its
KV-pool arithmetic (ARCHITECTURE.md 4.3) without loading a tensor or starting a process. Prints how
T, max_req_input_len and max_running_requests come about and which flag moves each (a table on
stdout, or one JSON object with --json); a start-up error is the last stderr line, as the server's.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from srt.server_args import ServerArgs, make_parser
from srt.utils.logging_utils import say_fatal

RAISE_T = ("raised by --mem-fraction-static, --max-total-tokens, --kv-cache-dtype fp8_e4m3 (and, on CPU where "
           "the pool is sized by need, --max-running-requests)")


class StartupFailure(Exception):
    """An error the server's start-up would end with (its last line, less the process suffix)."""


class Report:
    """What the dry run found, in order: `rows` (name, value, note) for the table, `data` for --json."""

    def __init__(self) -> None:
        self.rows: List[Tuple[str, str, str]] = []
        self.data: Dict[str, Any] = {"ok": False}

    def add(self, name: str, value: Any, note: str = "", **data: Any) -> None:
        self.rows.append((name, str(value), note))
        self.data.update(data)

    def table(self) -> str:
        width = [max((len(r[i]) for r in self.rows), default=0) for i in (0, 1)]
        lines = ["Start-up check (no weights loaded, no server started):"]
        lines += [f"  {n.ljust(width[0])}  {v.ljust(width[1])}  {note}".rstrip() for n, v, note in self.rows]
        lines += [f"warning: {w}" for w in self.data.get("warnings", [])]
        target = self.data.get("target")
        if target:
            lines.append(f"--target-input-len {target['input_len']}: {target['suggestion']}")
        if self.data.get("error"):
            lines.append("start-up would fail (last line of stderr).")
        return "\n".join(lines) + "\n"


def add_check_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dry run (check_config)")
    group.add_argument("--target-input-len", type=int, default=None, metavar="N",
                       help="Say whether an N-token prompt would be admitted and, if not, the smallest change "
                       "of flags that admits it (exit 1 when it is not admitted).")
    group.add_argument("--json", action="store_true", help="Print one JSON object instead of the table.")


def make_check_parser() -> argparse.ArgumentParser:
    parser = make_parser(prog="check_config")
    parser.description = ("Check launch_server flags like its start-up does, without loading weights or starting "
                          "a server, and print the KV-pool arithmetic.")
    add_check_args(parser)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    sys.exit(run_check(make_check_parser().parse_args(argv)))


def run_check(args: argparse.Namespace) -> int:
    """The dry run for parsed flags (check_config's or launch_server's); returns the exit code."""
    report = Report()
    try:
        _check(args, report)
        report.data["ok"] = True
    except StartupFailure as exc:
        report.data["error"] = str(exc)
    sys.stdout.write(json.dumps(report.data) + "\n" if args.json else report.table())
    sys.stdout.flush()
    target = report.data.get("target")
    last = report.data.get("error") or (target and not target["admitted"] and target["suggestion"])
    if last:
        say_fatal(last)
        return 1
    return 0


def _scheduler_step(fn: Callable, *args: Any) -> Any:
    """A step the scheduler process runs at start-up: its error reads as the server reports it."""
    from managers.scheduler_process import describe_startup_error

    try:
        return fn(*args)
    except Exception as exc:  # the server reports any start-up exception of the scheduler
        raise StartupFailure(describe_startup_error(exc)) from exc


def _frontend_step(fn: Callable, *args: Any) -> Any:
    """A step of the front process (`launch_server.run_server` reports these)."""
    try:
        return fn(*args)
    except (ValueError, RuntimeError) as exc:
        raise StartupFailure(str(exc)) from exc
    except OSError as exc:
        raise StartupFailure(f"{type(exc).__name__}: {exc}") from exc


def _check(args: argparse.Namespace, report: Report) -> None:
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as exc:
        raise StartupFailure(str(exc)) from None
    if args.target_input_len is not None and args.target_input_len < 1:
        raise StartupFailure(f"--target-input-len must be >= 1, got {args.target_input_len}.")
    from srt.launch_server import port_problem
    from srt.utils.logging_utils import configure_logging

    configure_logging(server_args.log_level or "warning")
    problem = port_problem(server_args.host, server_args.port)
    if problem:
        raise StartupFailure(problem)
    from srt.configs.model_config import check_model_dir

    _frontend_step(check_model_dir, server_args.model_path)
    _check_sizes(server_args, args.target_input_len, report)
    _check_tokenizer(server_args, report)


def _check_sizes(server_args: ServerArgs, target_len: Optional[int], report: Report) -> None:
    """The scheduler's start-up (`ModelRunner`) up to the pools: device, config, weights, KV budget."""
    import torch

    from mem_cache.memory_pool import MHATokenToKVPool
    from srt.check_config_target import ContextInfo, plan_target
    from srt.check_config_weights import loaded_model_nbytes
    from srt.configs.model_config import ModelConfig
    from srt.model_executor.memory_sizing import read_free_memory
    from srt.model_executor.model_runner import resolve_device

    device = _scheduler_step(resolve_device, server_args.device)
    cfg = _scheduler_step(ModelConfig.from_server_args, server_args)
    pre = _scheduler_step(read_free_memory, device)
    report.add("model", server_args.model_path, ", ".join(cfg.architectures), model_path=server_args.model_path,
               architectures=cfg.architectures)
    report.add("device", device, f"--device {server_args.device}; memory read from {pre.source}", device=device,
               memory_source=pre.source)
    word = "GPU" if device.startswith("cuda") else "host"
    report.add(f"free {word} memory before loading", f"pre = {_size(pre.free_bytes)}", f"of {_size(pre.total_bytes)}",
               pre_bytes=pre.free_bytes, total_bytes=pre.total_bytes)
    from srt.distributed.tp_config import check_tp_size

    _scheduler_step(check_tp_size, cfg, server_args.tp_size)
    weights = _check_weights(server_args, cfg, device, report)
    if server_args.tp_size > 1:
        weights //= server_args.tp_size
        report.add("weights per TP rank", f"{_size(weights)}", f"about 1/{server_args.tp_size} of the weights "
                   "(--tp-size)", weight_bytes_per_rank=weights, tp_size=server_args.tp_size)
    inputs = _sizing_inputs(server_args, cfg, device, pre, weights, report)
    budget, error = None, None
    try:
        budget = _scheduler_step(inputs.budget)
    except StartupFailure as exc:
        error = str(exc)
    derived = cfg if server_args.context_length is None else ModelConfig.load(
        server_args.model_path, server_args.dtype, server_args.kv_cache_dtype, None, server_args.tokenizer_path)
    report.data.update(context_len=cfg.context_len, context_len_source=cfg.context_len_source,
                       context_len_derived=derived.context_len, page_size=server_args.page_size)
    if budget is not None:
        _budget_rows(budget, server_args, derived.context_len, report)
    if target_len is not None:
        context = ContextInfo(derived.context_len, derived.context_len_source, lambda c: loaded_model_nbytes(
            cfg, c, device, server_args.enable_torch_compile, server_args.torch_compile_max_bs))
        fp8_cell = MHATokenToKVPool.cell_size_bytes(cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                                                    torch.float8_e4m3fn)
        report.data["target"] = plan_target(target_len, inputs, context, fp8_cell, budget, error)
        _add_tp_alternative(report.data["target"], target_len, inputs, server_args, cfg)
    if error:
        raise StartupFailure(error)


def _add_tp_alternative(plan: Dict[str, Any], n: int, inputs: Any, server_args: ServerArgs, cfg: Any) -> None:
    """Not admitted on CUDA: say which --tp-size would admit it (more GPUs, each with less to hold)."""
    from mem_cache.memory_pool import MHATokenToKVPool
    from srt.check_config_target import tp_alternative
    from srt.check_config_weights import loaded_model_nbytes
    from srt.distributed.tp_config import num_kv_heads_per_rank, valid_tp_sizes

    if plan["admitted"] or inputs.device_kind != "cuda":
        return

    def cell_at(t: int) -> int:
        return MHATokenToKVPool.cell_size_bytes(num_kv_heads_per_rank(cfg.num_key_value_heads, t), cfg.head_dim,
                                                cfg.num_hidden_layers, cfg.kv_cache_dtype)

    alt = tp_alternative(n, inputs, loaded_model_nbytes(cfg, None, "cuda"), server_args.tp_size, valid_tp_sizes(cfg),
                         cell_at)
    if alt is not None:
        plan["tp_alternative"] = alt
        plan["suggestion"] += " " + alt["text"]


def _sizing_inputs(server_args: ServerArgs, cfg: Any, device: str, pre: Any, weights: int, report: Report):
    """`ModelRunner._size_kv_pool`'s arguments to `compute_kv_budget`, each shown as a row."""
    import torch

    from mem_cache.memory_pool import MHATokenToKVPool
    from srt.check_config_target import SizingInputs
    from srt.model_executor.memory_sizing import default_mem_fraction_static

    kind = "cuda" if device.startswith("cuda") else "cpu"
    from kernels.attention import resolve_attention_backend
    from srt.model_executor.cuda_graph_runner import graph_reserve_bytes

    try:
        backend = resolve_attention_backend(server_args.attention_backend, device, cfg.dtype)
    except ValueError:  # reported by the backend check itself
        backend = "torch_native"
    reserve = graph_reserve_bytes(server_args, cfg, kind, backend)
    if reserve:
        report.add("CUDA graph reserve", _size(reserve), "kept outside the default fraction; --disable-cuda-graph, "
                   "--cuda-graph-max-bs", graph_reserve_bytes=reserve)
    fraction = server_args.mem_fraction_static or default_mem_fraction_static(kind, pre.total_bytes, reserve)
    from srt.distributed.tp_config import cpu_fraction_share, local_rank_count, num_kv_heads_per_rank

    if kind == "cpu" and local_rank_count(server_args) > 1:
        fraction = cpu_fraction_share(fraction, server_args)
        report.add("per-rank share", f"f / {local_rank_count(server_args)}", "on CPU the local ranks share host RAM")
    default = server_args.mem_fraction_static is None
    report.add("mem_fraction_static", f"f = {fraction:g}" + (f" (default on {kind})" if default else ""),
               "--mem-fraction-static", mem_fraction_static=fraction, mem_fraction_static_is_default=default)
    avail = pre.free_bytes - weights
    report.add("free after loading", f"avail = pre - weights = {_size(avail)}",
               "an estimate: the server measures free GPU memory after loading" if kind == "cuda" else "",
               avail_bytes=avail, avail_is_estimate=kind == "cuda")
    reserved = pre.free_bytes * (1 - fraction)
    rest = int(avail - reserved)  # as compute_kv_budget rounds it
    report.add("reserved", f"(1 - f) x pre = {_size(int(reserved))}", "left outside the static budget",
               reserved_bytes=int(reserved))
    report.add("KV budget", f"rest = avail - pre x (1 - f) = {_size(rest)}",
               "" if rest > 0 else "no room: start-up fails", rest_bytes=rest)
    heads, dim, layers = num_kv_heads_per_rank(cfg.num_key_value_heads, server_args.tp_size), cfg.head_dim, \
        cfg.num_hidden_layers
    cell = MHATokenToKVPool.cell_size_bytes(heads, dim, layers, cfg.kv_cache_dtype)
    elem = torch.empty((), dtype=cfg.kv_cache_dtype).element_size()
    formula = f"{heads} x {dim} x {layers} x 2 x {elem} = {cell} B"
    report.add("KV bytes per token", f"cell = {formula}",
               f"num_kv_heads x head_dim x num_layers x 2 x {_dtype(cfg.kv_cache_dtype)} bytes; "
               f"--kv-cache-dtype fp8_e4m3: 1-byte elements", cell_size=cell, cell_formula=formula,
               kv_cache_dtype=_dtype(cfg.kv_cache_dtype))
    return SizingInputs(pre.free_bytes, avail, fraction, cell, server_args.page_size, cfg.context_len,
                        server_args.max_total_tokens, server_args.max_running_requests, kind)


def _check_weights(server_args: ServerArgs, cfg: Any, device: str, report: Report) -> int:
    from srt.check_config_weights import checkpoint_size, loaded_model_nbytes

    # The model class first, as get_model.
    nbytes = _scheduler_step(loaded_model_nbytes, cfg, None, device, server_args.enable_torch_compile,
                             server_args.torch_compile_max_bs)
    if server_args.load_format == "dummy":
        report.add("weights on disk", "none", "--load-format dummy: seeded random weights", weight_bytes_disk=None)
    else:
        disk = _scheduler_step(checkpoint_size, cfg.model_path)
        report.add("weights on disk", _size(disk.nbytes),
                   f"{disk.num_tensors} tensors, {', '.join(disk.dtypes)}, in {len(disk.files)} safetensors file(s)",
                   weight_bytes_disk=disk.nbytes, checkpoint_dtypes=disk.dtypes)
    report.add("weights in memory", _size(nbytes), f"at {_dtype(cfg.dtype)} (--dtype): parameters and buffers "
               "(rotary cos/sin), tied weights once", weight_bytes=nbytes, dtype=_dtype(cfg.dtype))
    return nbytes


def _budget_rows(budget: Any, server_args: ServerArgs, derived: int, report: Report) -> None:
    C, T = budget.context_len, budget.max_total_num_tokens
    report.add("page size", f"P = {budget.page_size}", "--page-size")
    report.add("T (max_total_num_tokens)", T, f"bound by {budget.total_bound}; {RAISE_T}",
               max_total_num_tokens=T, kv_bytes=budget.kv_bytes)
    report.add("max_running_requests", budget.max_running_requests,
               f"bound by {budget.running_bound}; set with --max-running-requests",
               max_running_requests=budget.max_running_requests)
    source = report.data["context_len_source"]
    given = f"--context-length (derived {derived} from {source})" if server_args.context_length else source
    report.add("context length", f"C = {C}", f"from {given}; set with --context-length")
    report.add("max_req_len", f"{budget.max_req_len} = min(C - 1, T - 1)", "", max_req_len=budget.max_req_len)
    raise_input = "raised by --context-length" if budget.input_bound.startswith("context") else RAISE_T
    report.add("max_req_input_len", f"{budget.max_req_input_len} = max_req_len - 5",
               f"bound by {budget.input_bound}; {raise_input}", max_req_input_len=budget.max_req_input_len,
               kv_budget=budget.to_dict(), warnings=list(budget.warnings))


def _check_tokenizer(server_args: ServerArgs, report: Report) -> None:
    """The tokenizer (scheduler, then front process) and the chat template (front process)."""
    from managers.template_manager import TemplateManager
    from srt.utils.hf_transformers_utils import get_tokenizer

    tokenizer = _scheduler_step(get_tokenizer, server_args.tokenizer_path, server_args.trust_remote_code)
    report.add("tokenizer", type(tokenizer).__name__, server_args.tokenizer_path, tokenizer=type(tokenizer).__name__)
    template = _frontend_step(TemplateManager.load, tokenizer, server_args.chat_template, server_args.model_path)
    source = template.source if template.chat_template is not None else None
    report.add("chat template", source or "none", "--chat-template" if source else
               "chat requests will get a 400 naming --chat-template", chat_template=source)


def _size(n: int) -> str:
    from srt.model_executor.memory_sizing import fmt_gib

    return f"{n} B ({fmt_gib(n)})"


def _dtype(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


if __name__ == "__main__":
    main()
