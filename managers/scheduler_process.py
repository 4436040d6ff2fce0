"""Entry point of the scheduler process: model runner + scheduler loop over zmq sockets."""

from __future__ import annotations

import logging
import signal
import sys
import traceback
from typing import Any, List

import setproctitle
import zmq

from managers.io_struct import SchedulerReady

logger = logging.getLogger(__name__)


class ZmqChannels:
    """PULL from the tokenizer manager (bound here), PUSH to the detokenizer."""

    def __init__(self, port_args):
        self.ctx = zmq.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(port_args.scheduler_input_ipc_name)
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
                out.append(self.pull.recv_pyobj(zmq.NOBLOCK))
            except zmq.Again:
                return out

    def send(self, msg: Any) -> None:
        self.push.send_pyobj(msg)


def describe_startup_error(e: BaseException) -> str:
    """Our own start-up errors (bad path, memory arithmetic, flags, tokenizer) are sentences meant
    for the user and are sent as they are; anything else keeps its type name."""
    from srt.utils.hf_transformers_utils import TokenizerLoadError

    if isinstance(e, (ValueError, FileNotFoundError, TokenizerLoadError)) and str(e):
        return str(e)
    return f"{type(e).__name__}: {e}"


def run_scheduler_process(server_args, port_args, ready_writer) -> None:
    """Report `SchedulerReady` (numbers or the root-cause error) on `ready_writer`, then serve
    until SIGTERM. A crash later is reported on the same pipe before the process exits."""
    from srt.utils.logging_utils import configure_logging

    setproctitle.setproctitle("srt::scheduler")
    configure_logging(getattr(server_args, "log_level", None), prefix="scheduler")
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front process decides when to stop
    try:
        scheduler, channels = _build(server_args, port_args)
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
        while not stop["flag"]:
            channels.block_ms = 20 if scheduler.is_idle() else 0
            if not scheduler.step() and not scheduler.is_idle():
                continue
    except Exception as e:
        text = f"Scheduler crashed: {type(e).__name__}: {e}"
        logger.error("%s\n%s", text, traceback.format_exc())
        try:
            ready_writer.send(SchedulerReady(False, error=text))
        finally:
            sys.exit(1)
    channels.ctx.destroy(linger=0)


def _build(server_args, port_args):
    from managers.scheduler import Scheduler
    from srt.model_executor.model_runner import ModelRunner
    from srt.utils.hf_transformers_utils import get_tokenizer

    runner = ModelRunner(server_args)
    tokenizer = get_tokenizer(server_args.tokenizer_path, trust_remote_code=server_args.trust_remote_code)
    channels = ZmqChannels(port_args)
    scheduler = Scheduler(server_args, runner, tokenizer=tokenizer, recv=channels.recv, send=channels.send)
    return scheduler, channels
