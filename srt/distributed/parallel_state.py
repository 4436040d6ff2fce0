"""Tensor-parallel state on torch.distributed (gloo on CPU, NCCL on CUDA), SGLang's names.

One process per TP rank. `init_tp_group` joins the group (a no-op for tp = 1, so single-device
runs never touch torch.distributed); layers then ask `get_tp_rank()` / `get_tp_size()` and call
`tensor_model_parallel_all_reduce` / `tensor_model_parallel_all_gather`. Python objects (the
scheduler's requests) travel over a separate gloo group (`broadcast_object`), as in SGLang,
so NCCL carries tensors only.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from srt.distributed.rendezvous import create_tcp_store

logger = logging.getLogger(__name__)


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    backend: str = "none"
    device_group: Any = None  # tensors (gloo or NCCL)
    cpu_group: Any = None  # Python objects (always gloo)


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.world_size


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_tp_group(tp_size: int, rank: int, init_method: str, device: str, timeout_s: float = 600.0) -> TPGroup:
    """Join the TP group of `tp_size` ranks at `init_method` (tcp://host:port). tp = 1: nothing.
    Rank 0 hosts the rendezvous store on `host` alone (see `srt.distributed.rendezvous`)."""
    global _TP
    if tp_size == 1:
        _TP = TPGroup()
        return _TP
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = create_tcp_store(init_method, rank, tp_size, timeout)
    dist.init_process_group(backend, store=store, world_size=tp_size, rank=rank, timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    _TP = TPGroup(rank, tp_size, backend, dist.group.WORLD, cpu_group)
    logger.info("TP rank %d of %d joined (%s, %s).", rank, tp_size, backend, init_method)
    return _TP


def destroy_tp_group() -> None:
    global _TP
    if _TP.world_size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks (in place; returns `x`). Identity for tp = 1."""
    if _TP.world_size == 1:
        return x
    dist.all_reduce(x, group=_TP.device_group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order. Identity for tp = 1."""
    if _TP.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.device_group)
    return torch.cat(parts, dim=dim)


def broadcast_tensor(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank (in place). Identity for tp = 1."""
    if _TP.world_size > 1:
        dist.broadcast(x, src=src, group=_TP.device_group)
    return x


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s Python object on every rank (over the gloo group)."""
    if _TP.world_size == 1:
        return obj
    box: List[Optional[Any]] = [obj if _TP.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=_TP.cpu_group)
    return box[0]


def all_reduce_min_int(values: List[int]) -> List[int]:
    """Element-wise minimum of integer lists over the TP ranks (start-up agreement)."""
    if _TP.world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device="cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return [int(v) for v in t.tolist()]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tp-size {denominator}.")
    return numerator // denominator
