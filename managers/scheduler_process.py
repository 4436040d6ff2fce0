"""Entry point of the scheduler process: model runner + scheduler loop over zmq sockets.

The loop marks each step on the rank's `Heartbeat`; a watchdog thread beats it, and when one step
runs past --watchdog-timeout it dumps every thread's stack to the log, reports, and exits non-zero.
"""

from __future__ import annotations

import copy
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import setproctitle
import zmq

from managers import ipc
from managers.io_struct import SchedulerReady, StopSchedulerReq
from srt.server_args import effective_chunked_prefill_size
from srt.utils.heartbeat import Heartbeat

logger = logging.getLogger(__name__)


class ZmqChannels:
    """PULL from the tokenizer manager (bound here), PUSH to the detokenizer."""

    def __init__(self, port_args, input_name: Optional[str] = None):
        self.ctx = zmq.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(input_name or port_args.scheduler_input_ipc_name)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(port_args.detokenizer_ipc_name)
        self.block_ms = 0

    def recv(self) -> List[Any]:
        """Drain pending messages; wait up to `block_ms` for the first one (when idle)."""
        out: List[Any] = []
        if self.block_ms and not self.pull.poll(self.block_ms):
            return out
        while True:
            try:
                out.append(ipc.recv(self.pull, zmq.NOBLOCK))
            except zmq.Again:
                return out
            except ipc.IPCDecodeError as exc:  # a frame that is not ours: dropped, never executed
                logger.warning("Scheduler dropped a message: %s", exc)

    def send(self, msg: Any) -> None:
        ipc.send(self.push, msg)


def describe_startup_error(e: BaseException) -> str:
    """Our own start-up errors (bad path, memory arithmetic, flags, tokenizer) are sentences meant
    for the user and are sent as they are; anything else keeps its type name."""
    from srt.utils.hf_transformers_utils import TokenizerLoadError

    if isinstance(e, (ValueError, FileNotFoundError, TokenizerLoadError)) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}"


@dataclass
class RankInfo:
    """Where one scheduler process sits: its TP rank (and data-parallel replica), the rendezvous,
    the local GPU, and the node layout (to name a lost rank's node)."""

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: Optional[int] = None
    dist_init_method: Optional[str] = None
    gpu_id: Optional[int] = None
    nnodes: int = 1
    input_ipc_name: Optional[str] = None  # this replica's socket (default: port_args' scheduler input)
    heartbeat: Optional[Heartbeat] = None  # shared with the front (readiness, watchdog)

    @property
    def title(self) -> str:
        dp = f"_DP{self.dp_rank}" if self.dp_rank is not None else ""
        return f"srt::scheduler{dp}_TP{self.tp_rank}" if self.tp_size > 1 or dp else "srt::scheduler"

    def node_of(self, rank: int) -> int:
        return rank // max(self.tp_size // self.nnodes, 1)

    def describe_peers(self) -> str:
        peers = [r for r in range(self.tp_size) if r != self.tp_rank]
        return ", ".join(f"TP rank {r} (node {self.node_of(r)})" for r in peers)


class PeerLost(RuntimeError):
    """A collective with the other TP ranks failed: a rank (or its node) is gone."""


class SchedulerWatchdog:
    """A daemon thread: beats `heartbeat` every `interval`; when one scheduler step has run for
    `timeout` seconds (0 = never), it calls `on_stuck(message)` once, after dumping the stack of
    every thread to `file`. It runs while the main thread is inside a forward (native code
    releases the GIL), so a stuck forward is reported from inside the process with its stack."""

    def __init__(self, heartbeat: Heartbeat, timeout: float, on_stuck: Callable[[str], None],
                 interval: float = 0.5, file: Any = None):
        self.heartbeat, self.timeout, self.on_stuck = heartbeat, timeout, on_stuck
        self.interval = min(interval, timeout / 4) if timeout > 0 else interval
        self.file = file
        self._thread = threading.Thread(target=self._run, name="srt-scheduler-watchdog", daemon=True)

    def start(self) -> "SchedulerWatchdog":
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.heartbeat.beat()
            running = self.heartbeat.step_running_for()
            if self.timeout > 0 and running > self.timeout:
                message = (f"Scheduler watchdog: one scheduler step has run for {running:.0f} s "
                           f"(--watchdog-timeout={self.timeout:g}); a forward pass is stuck. The stack of "
                           f"every scheduler thread is in the log above.")
                logger.error("%s Stacks:", message)
                faulthandler.dump_traceback(file=self.file or sys.stderr, all_threads=True)
                self.on_stuck(message)
                return
            time.sleep(self.interval)


def _exit_stuck(ready_writer, message: str) -> None:
    """The watchdog's verdict: tell the front (its last line) and end the process at once."""
    try:
        ready_writer.send(SchedulerReady(False, error=message))
    except (OSError, ValueError):
        pass
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def run_scheduler_process(server_args, port_args, ready_writer, rank: Optional[RankInfo] = None) -> None:
    """Report `SchedulerReady` (numbers or the root-cause error) on `ready_writer`, then serve
    until SIGTERM. A crash later is reported on the same pipe before the process exits.

    With TP, TP rank 0 alone talks to the tokenizer manager and the detokenizer: each step it
    broadcasts what it received, so every rank schedules the same batches."""
    from srt.utils.logging_utils import configure_logging

    rank = rank or RankInfo()
    setproctitle.setproctitle(rank.title)
    prefix = "scheduler" if rank.tp_size == 1 and rank.dp_rank is None else rank.title.split("::")[1]
    configure_logging(getattr(server_args, "log_level", None), prefix=prefix)
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front process decides when to stop
    heartbeat = rank.heartbeat or Heartbeat()
    SchedulerWatchdog(heartbeat, server_args.watchdog_timeout, lambda why: _exit_stuck(ready_writer, why)).start()
    try:
        scheduler, channels = _build(server_args, port_args, rank)
    except Exception as e:  # root cause, not a generic "initialization failed"
        logger.debug("scheduler start-up failed", exc_info=True)
        ready_writer.send(SchedulerReady(False, error=describe_startup_error(e)))
        sys.exit(1)
    runner = scheduler.runner
    ready_writer.send(SchedulerReady(
        True, max_total_num_tokens=runner.max_total_num_tokens, max_req_input_len=runner.max_req_input_len,
        max_req_len=runner.max_req_len, max_running_requests=runner.max_running_requests,
        context_len=runner.model_config.context_len, vocab_size=runner.model_config.vocab_size,
        kv_budget=runner.kv_budget.to_dict()))
    try:
        _loop(scheduler, channels, rank, stop, heartbeat)
    except Exception as e:
        text = str(e) if isinstance(e, PeerLost) else f"Scheduler crashed: {type(e).__name__}: {e}"
        logger.error("%s\n%s", text, traceback.format_exc())
        try:
            ready_writer.send(SchedulerReady(False, error=text))
        finally:
            sys.exit(1)
    if channels is not None:
        channels.ctx.destroy(linger=0)


def _loop(scheduler, channels, rank: RankInfo, stop, heartbeat: Heartbeat) -> None:
    if rank.tp_size == 1:
        while not stop["flag"]:
            channels.block_ms = 20 if scheduler.is_idle() else 0
            heartbeat.step_begin()
            scheduler.step()
            heartbeat.step_end()
        return
    from srt.distributed.parallel_state import broadcast_object

    def recv() -> List[Any]:
        if rank.tp_rank == 0:
            channels.block_ms = 20 if scheduler.is_idle() else 0
            msgs = [StopSchedulerReq()] if stop["flag"] else channels.recv()
        else:
            msgs = None
        try:
            return broadcast_object(msgs, src=0)
        except Exception as exc:
            raise PeerLost(f"Lost contact with {rank.describe_peers()}: {type(exc).__name__}: {exc}") from exc

    scheduler.recv = recv
    while not scheduler.stopped:  # every rank stops on rank 0's word (its SIGTERM) or a lost peer
        heartbeat.step_begin()
        scheduler.step()
        heartbeat.step_end()


def _share_cpu_threads(server_args) -> None:
    """CPU with several local ranks: split the cores between them (unless OMP_NUM_THREADS says),
    so TP/DP ranks do not oversubscribe the machine."""
    import os

    import torch

    from srt.distributed.tp_config import local_rank_count

    ranks = local_rank_count(server_args)
    if ranks > 1 and server_args.device != "cuda" and "OMP_NUM_THREADS" not in os.environ:
        if server_args.device == "cpu" or not torch.cuda.is_available():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def _build(server_args, port_args, rank: RankInfo):
    from managers.scheduler import Scheduler
    from srt.model_executor.model_runner import ModelRunner
    from srt.utils.hf_transformers_utils import get_tokenizer

    _share_cpu_threads(server_args)
    runner = ModelRunner(server_args, tp_rank=rank.tp_rank, dist_init_method=rank.dist_init_method,
                         gpu_id=rank.gpu_id)
    # The documented per-device default of --chunked-prefill-size, now that the device is known
    # (a copy: the caller's args stay as given).
    server_args = copy.copy(server_args)
    server_args.chunked_prefill_size = effective_chunked_prefill_size(server_args.chunked_prefill_size,
                                                                      runner.device)
    tokenizer = get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)
    channels = ZmqChannels(port_args, rank.input_ipc_name) if rank.tp_rank == 0 else None
    send = channels.send if channels is not None else (lambda msg: None)
    recv = channels.recv if channels is not None else (lambda: [])
    scheduler = Scheduler(server_args, runner, tokenizer=tokenizer, recv=recv, send=send)
    scheduler.dp_rank = rank.dp_rank or 0
    return scheduler, channels
