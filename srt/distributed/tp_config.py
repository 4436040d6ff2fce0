"""Which `--tp-size` values a model admits, and how many KV heads each rank holds."""

from __future__ import annotations

from typing import List


def num_kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split evenly, or replicated (one per rank) when tp exceeds them."""
    return max(1, num_kv_heads // tp_size)


def _fits(cfg, tp: int) -> bool:
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    kv_ok = (kv % tp == 0) if tp <= kv else (tp % kv == 0)
    return heads % tp == 0 and kv_ok and cfg.intermediate_size % tp == 0


def valid_tp_sizes(cfg) -> List[int]:
    return [t for t in range(1, cfg.num_attention_heads + 1) if _fits(cfg, t)]


def check_tp_size(cfg, tp_size: int) -> None:
    """Refuse a `--tp-size` the model's shapes cannot split, naming the numbers and the valid sizes."""
    if tp_size == 1 or _fits(cfg, tp_size):
        return
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    reasons = []
    if heads % tp_size:
        reasons.append(f"num_attention_heads {heads} is not divisible by it")
    if tp_size <= kv and kv % tp_size:
        reasons.append(f"num_key_value_heads {kv} is not divisible by it")
    if tp_size > kv and tp_size % kv:
        reasons.append(f"it is not a multiple of num_key_value_heads {kv} (needed to replicate KV heads)")
    if inter % tp_size:
        reasons.append(f"intermediate_size {inter} is not divisible by it")
    raise ValueError(f"--tp-size {tp_size} does not fit this model: {'; '.join(reasons)}. "
                     f"Valid --tp-size values: {', '.join(map(str, valid_tp_sizes(cfg)))}.")


def local_rank_count(server_args) -> int:
    """Scheduler processes on this node: TP ranks per node times data-parallel replicas."""
    return server_args.tp_size // server_args.nnodes * server_args.dp_size


def cpu_fraction_share(fraction: float, server_args) -> float:
    """On CPU every local rank sizes its pool from the same host RAM: each takes an equal share of
    --mem-fraction-static (on CUDA each rank has its own GPU and the whole fraction)."""
    return fraction / local_rank_count(server_args)


def check_gpu_count(server_args, visible: int, env_value: str = "") -> None:
    """CUDA: every local rank needs its own GPU."""
    need = local_rank_count(server_args)
    if need > visible:
        shown = f" (CUDA_VISIBLE_DEVICES={env_value})" if env_value else ""
        raise ValueError(f"--tp-size {server_args.tp_size} x --dp-size {server_args.dp_size} needs {need} GPUs on "
                         f"this node (one per rank), but torch sees {visible}{shown}. Lower --tp-size or --dp-size, "
                         f"spread the ranks over nodes with --nnodes, or make more GPUs visible.")
