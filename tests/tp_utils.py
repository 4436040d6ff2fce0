"""Run a function on every rank of a TP group (gloo on CPU), one spawned process per rank."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, List

from server_utils import free_port

TESTS = Path(__file__).resolve().parent


def _worker(fn: Callable, rank: int, tp: int, port: int, args: tuple, queue) -> None:
    for p in (str(TESTS.parent), str(TESTS)):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)  # 2 cores, 2 ranks
    try:
        # Plain pickle bytes: torch's queue reductions would pass tensors as shared-memory handles
        # that die with this process.
        queue.put((rank, pickle.dumps(fn(rank, tp, f"tcp://127.0.0.1:{port}", *args)), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        from srt.distributed.parallel_state import destroy_tp_group

        destroy_tp_group()


def run_on_ranks(fn: Callable, tp: int, *args: Any, timeout: float = 300.0) -> List[Any]:
    """`fn(rank, tp, init_method, *args)` on ranks 0 .. tp-1; returns the results in rank order,
    or raises with the failing rank's traceback."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, tp, port, args, queue), daemon=True) for r in range(tp)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(tp):
            rank, value, error = queue.get(timeout=timeout)
            if error:
                raise AssertionError(f"TP rank {rank} failed:\n{error}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(tp)]
