"""Spawn the scheduler and detokenizer processes, wait for their handshake, watch them, stop them.

A child that fails to start or dies later is reported with its own error text (sent over its
ready pipe), never a generic "initialization failed". Every child runs under a `ChildGuard`, so it
exits, and removes the socket folder, when this process dies, even by SIGKILL. Each scheduler rank
writes a `Heartbeat` that readiness and the watchdog read.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Callable, Dict, List, Optional

from managers.io_struct import SchedulerReady
from srt.utils.heartbeat import Heartbeat
from srt.utils.process_guard import STACK_DUMP_SIGNAL, ChildGuard, describe_state, process_state, run_child

logger = logging.getLogger(__name__)


def scheduler_name(tp_rank: int, dp_rank: int = 0) -> str:
    """"Scheduler" for TP rank 0 of replica 0 (every message names it so), else "Scheduler TP<r>",
    "Scheduler DP<d>" or "Scheduler DP<d> TP<r>"."""
    parts = ["Scheduler"] + ([f"DP{dp_rank}"] if dp_rank else []) + ([f"TP{tp_rank}"] if tp_rank else [])
    return " ".join(parts)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_gpus(args) -> None:
    """Before spawning ranks on CUDA: one GPU per local rank (`device auto` means CUDA when present)."""
    if args.device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        return  # --device auto falls back to CPU; --device cuda fails in the rank with its own message
    from srt.distributed.tp_config import check_gpu_count

    check_gpu_count(args, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES", ""))


class RuntimeProcessError(RuntimeError):
    """A runtime subprocess failed to start or died; the message is its root cause."""


@dataclass
class PortArgs:
    tmpdir: str
    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str

    @classmethod
    def create(cls) -> "PortArgs":
        tmp = tempfile.mkdtemp(prefix="srt-ipc-")
        return cls(tmp, f"ipc://{tmp}/tokenizer", f"ipc://{tmp}/scheduler", f"ipc://{tmp}/detokenizer")

    def scheduler_input_names(self, dp_size: int) -> List[str]:
        """Each data-parallel replica's input socket (replica 0's is `scheduler_input_ipc_name`)."""
        return [self.scheduler_input_ipc_name] + [f"{self.scheduler_input_ipc_name}_dp{d}" for d in range(1, dp_size)]


def _describe_exit(name: str, proc: mp.Process, message: str) -> str:
    code = proc.exitcode
    if message:  # the child's own error first, so the searchable sentence starts the line
        return f"{message} [{name} process, pid {proc.pid}]"
    if code is not None and code < 0:
        sig = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        return f"{name} process (pid {proc.pid}) died unexpectedly (killed by signal {sig})."
    return f"{name} process (pid {proc.pid}) exited unexpectedly with code {code}."


@contextmanager
def _without_main_reimport():
    """Children run functions of our own modules and need nothing from `__main__`, but the
    spawn start method re-runs the parent's main script in each child. That breaks scripts
    without an `if __name__ == "__main__":` guard (the child would start an engine again) and
    scripts read from stdin. Hiding the main module's origin while starting avoids both."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        for k in saved:
            setattr(main, k, None) if k == "__spec__" else delattr(main, k)
        yield
    finally:
        for k, v in saved.items():
            setattr(main, k, v)


class RuntimeProcesses:
    def __init__(self, server_args):
        self.server_args = server_args
        self.port_args = PortArgs.create()
        self.procs: Dict[str, mp.Process] = {}
        self.pipes: Dict[str, object] = {}
        self.scheduler_info: Optional[SchedulerReady] = None
        self.heartbeats: Dict[str, Heartbeat] = {}  # scheduler ranks only
        self._stopping = False
        self._watcher: Optional[threading.Thread] = None
        # The child watchdog (a child died) and the main thread (start-up failed, Ctrl-C) may both
        # shut down at once; one at a time, each over a snapshot of the children.
        self._shutdown_lock = threading.Lock()

    def start(self) -> SchedulerReady:
        """Spawn this node's scheduler ranks (and, on node 0, the detokenizer); wait for every
        handshake at once, so a rank that fails is reported even while the others wait for it
        at the TP rendezvous. Returns TP rank 0's numbers (None on a node without rank 0)."""
        from managers.detokenizer_manager import run_detokenizer_process
        from managers.scheduler_process import RankInfo, run_scheduler_process

        args = self.server_args
        tp, dp, nnodes, node = args.tp_size, args.dp_size, args.nnodes, args.node_rank
        per_node = tp // nnodes
        if tp * dp > 1:
            _check_gpus(args)
        inputs = self.port_args.scheduler_input_names(dp)
        for d in range(dp):  # each replica: its own TP group (rendezvous), socket, pool and cache
            if args.dist_init_addr and d == 0:
                init = f"tcp://{args.dist_init_addr}"
            else:
                init = f"tcp://127.0.0.1:{_free_port()}"
            for r in range(node * per_node, (node + 1) * per_node):
                name = scheduler_name(r, d)
                self.heartbeats[name] = Heartbeat(mp.get_context("spawn"))
                rank = RankInfo(tp_rank=r, tp_size=tp, dp_rank=d if dp > 1 else None,
                                dist_init_method=init if tp > 1 else None,
                                gpu_id=d * tp + r - node * per_node if tp * dp > 1 else None,
                                nnodes=nnodes, input_ipc_name=inputs[d], heartbeat=self.heartbeats[name])
                self._spawn(name, run_scheduler_process, (args, self.port_args), (rank,))
        if node == 0:
            self._spawn("Detokenizer", run_detokenizer_process, (args, self.port_args), ())
        try:
            ready = self._wait_all_ready()
        except RuntimeProcessError:
            self.shutdown()
            raise
        self.scheduler_info = ready.get("Scheduler")
        return self.scheduler_info

    def _spawn(self, name: str, target, head: tuple, tail: tuple) -> None:
        ctx = mp.get_context("spawn")
        reader, writer = ctx.Pipe(duplex=False)
        guard = ChildGuard(os.getpid(), self.port_args.tmpdir)  # dies with us, removing the socket folder
        proc = ctx.Process(target=run_child, args=(guard, target, *head, writer, *tail), name=name, daemon=True)
        with _without_main_reimport():
            proc.start()
        writer.close()
        self.procs[name], self.pipes[name] = proc, reader

    def _wait_all_ready(self) -> Dict[str, object]:
        pending, ready = set(self.procs), {}
        while pending:
            handles = {self.pipes[n]: n for n in pending}
            handles.update({self.procs[n].sentinel: n for n in pending})
            for name in sorted({handles[h] for h in wait(list(handles), timeout=1.0)}):
                pipe, proc = self.pipes[name], self.procs[name]
                if not pipe.poll(0.5 if not proc.is_alive() else 0):  # died without a word
                    proc.join(1)
                    raise RuntimeProcessError(_describe_exit(name, proc, ""))
                try:
                    msg = pipe.recv()
                except EOFError:
                    msg = None
                ok = getattr(msg, "ok", None) if not isinstance(msg, dict) else msg.get("ok")
                if ok:
                    ready[name] = msg
                    pending.discard(name)
                    continue
                error = getattr(msg, "error", None) if not isinstance(msg, dict) else msg.get("error")
                proc.join(5)
                raise RuntimeProcessError(_describe_exit(name, proc, error or ""))
        return ready

    def watch(self, on_death: Callable[[str], None], interval: float = 0.2) -> None:
        """Call `on_death(root cause)` once if any child dies while we are not stopping."""

        def run() -> None:
            sentinels = {p.sentinel: n for n, p in self.procs.items()}
            while not self._stopping:
                done = wait(list(sentinels), timeout=interval)
                if self._stopping or not done:
                    continue
                name = sentinels[done[0]]
                message = ""
                pipe, proc = self.pipes.get(name), self.procs.get(name)
                if pipe is None or proc is None:  # shut down meanwhile: nothing left to report
                    return
                try:
                    if pipe.poll(0.5):
                        msg = pipe.recv()
                        message = getattr(msg, "error", "") if not isinstance(msg, dict) else msg.get("error", "")
                except (EOFError, OSError):
                    pass
                proc.join(1)
                try:
                    on_death(_describe_exit(name, proc, message))
                except Exception:  # never let the watchdog die silently: callers would hang
                    logger.exception("child-death handler failed")
                return

        self._watcher = threading.Thread(target=run, name="srt-child-watchdog", daemon=True)
        self._watcher.start()

    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs.values())

    def silent_scheduler(self, stale_s: float) -> Optional[str]:
        """Why a scheduler rank counts as not answering (its heartbeat is older than `stale_s`:
        the process is stopped or frozen), or None."""
        for name, beat in self.heartbeats.items():
            silent = beat.silent_for()
            if silent > stale_s and name in self.procs:
                pid = self.procs[name].pid
                return f"{name} process (pid {pid}) has not answered for {silent:.0f} s: it {describe_state(pid)}."
        return None

    def stuck_scheduler(self, stale_s: float) -> Optional[str]:
        """Why a scheduler rank counts as busy (one step has run longer than `stale_s`), or None."""
        for name, beat in self.heartbeats.items():
            running = beat.step_running_for()
            if running > stale_s:
                return f"{name} has not answered for {running:.0f} s: one step (a forward pass) is still running."
        return None

    def dump_stacks(self, names) -> bool:
        """Ask the running ones of these children for the stack of every thread (faulthandler, to
        the shared stderr); True when any was asked (a stopped process cannot answer)."""
        asked = False
        for name in names:
            proc = self.procs.get(name)
            if proc is None or not proc.is_alive() or process_state(proc.pid) in ("T", "t", None):
                continue
            try:
                os.kill(proc.pid, STACK_DUMP_SIGNAL)
                asked = True
            except ProcessLookupError:
                pass
        if asked:
            time.sleep(0.3)  # faulthandler writes from the child's signal handler: let it land first
        return asked

    def pids(self) -> Dict[str, int]:
        return {n: p.pid for n, p in self.procs.items()}

    def shutdown(self, timeout: float = 5.0) -> None:
        """SIGTERM, wait, SIGKILL (at once for a stopped process, which cannot act on SIGTERM);
        remove the socket directory. Idempotent."""
        self._stopping = True
        with self._shutdown_lock:
            procs, pipes = list(self.procs.values()), list(self.pipes.values())
            for proc in procs:
                if proc.is_alive() and process_state(proc.pid) in ("T", "t"):
                    os.kill(proc.pid, signal.SIGKILL)
                elif proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join(timeout)
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join(1)
            for pipe in pipes:
                pipe.close()
            self.procs.clear()
            self.pipes.clear()
            shutil.rmtree(self.port_args.tmpdir, ignore_errors=True)
