"""The main process's side of the runtime, shared by `Engine` and the HTTP server.

`RuntimeFrontend` starts the scheduler and detokenizer, loads the tokenizer and chat template,
then (on the event loop that will serve requests) opens the zmq sockets and builds the
`TokenizerManager`. It also holds the two ways the front end gives up: a dead child and a
scheduler that stopped answering (a stuck forward).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import sys

from srt.utils.logging_utils import say_fatal
from typing import Any, Callable, Optional

import zmq
import zmq.asyncio

from managers import ipc
from managers.data_parallel_controller import DataParallelController
from managers.generate_input import RequestError
from managers.io_struct import BatchStrOut, SchedulerReady
from managers.template_manager import TemplateManager
from managers.tokenizer_manager import TokenizerManager
from srt.configs.model_config import check_model_dir
from srt.entrypoints.process_launcher import RuntimeProcesses
from srt.utils.hf_transformers_utils import get_tokenizer

logger = logging.getLogger(__name__)

PROBE_GRACE_S = 10.0  # a stuck step is the scheduler's own watchdog's to report (with its stack)


class RuntimeFrontend:
    """Runtime children + the sockets to them + a `TokenizerManager`, on one event loop.

    Use: `start()` (blocking: spawn and handshake, load the tokenizer), then `await connect()` on
    the serving loop, then `await close()` there and `shutdown()` from anywhere.
    """

    def __init__(self, server_args: Any):
        check_model_dir(server_args.model_path)  # fail fast, before any process starts
        self.server_args = server_args
        self.procs = RuntimeProcesses(server_args)
        self.scheduler_info: Optional[SchedulerReady] = None
        self.tokenizer: Any = None
        self.template: Optional[TemplateManager] = None
        self.tokenizer_manager: Optional[TokenizerManager] = None
        self._zmq: Optional[zmq.asyncio.Context] = None
        self.dp_controller: Optional[DataParallelController] = None
        self._recv_task: Optional[asyncio.Task] = None

    def start(self) -> SchedulerReady:
        """Spawn the children, wait for their `ready`, load the tokenizer and chat template.

        Raises `RuntimeProcessError` with a child's root cause; on any failure the children are
        stopped and the socket directory is removed."""
        self.scheduler_info = self.procs.start()
        try:
            args = self.server_args
            self.tokenizer = get_tokenizer(args.tokenizer_path, trust_remote_code=args.trust_remote_code)
            self.template = TemplateManager.load(self.tokenizer, args.chat_template, args.model_path)
        except BaseException:
            self.procs.shutdown()
            raise
        return self.scheduler_info

    async def connect(self) -> TokenizerManager:
        """Open the sockets and start receiving, on the running loop (which then owns them)."""
        self._zmq = zmq.asyncio.Context(2)
        sends = []
        for name in self.procs.port_args.scheduler_input_names(self.server_args.dp_size):
            to_scheduler = self._zmq.socket(zmq.PUSH)
            to_scheduler.connect(name)
            sends.append(functools.partial(ipc.send, to_scheduler))
        from_detokenizer = self._zmq.socket(zmq.PULL)
        from_detokenizer.bind(self.procs.port_args.tokenizer_ipc_name)
        send, on_release = sends[0], None
        if len(sends) > 1:
            self.dp_controller = DataParallelController(sends, self.server_args.load_balance_method)
            send, on_release = self.dp_controller.send, self.dp_controller.release
        self.tokenizer_manager = TokenizerManager(self.server_args, self.tokenizer, self.template,
                                                  self.scheduler_info, send, dp_size=len(sends),
                                                  on_release=on_release)
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop(from_detokenizer))
        return self.tokenizer_manager

    async def _recv_loop(self, sock: zmq.asyncio.Socket) -> None:
        tm = self.tokenizer_manager
        while True:
            try:
                msg = await ipc.recv_async(sock)
            except ipc.IPCDecodeError as exc:  # a frame that is not ours: dropped, never executed
                logger.warning("Front end dropped a message: %s", exc)
                continue
            if isinstance(msg, BatchStrOut):
                tm.handle_batch_str_out(msg)
            else:
                tm.handle_reply(msg)

    async def close(self) -> None:
        """Stop receiving and close the sockets (on the loop that called `connect`)."""
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None
        if self.tokenizer_manager is not None:
            self.tokenizer_manager.close()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the children and remove the socket directory. Idempotent, any thread."""
        self.procs.shutdown(timeout)

    def exit_with(self, reason: str, code: int = 1) -> None:
        """Stop everything and end the process with `reason` as the last line printed."""
        # Stop the other children and multiprocessing's resource tracker first, so the root
        # cause is the last line printed, not their shutdown chatter.
        self.procs.shutdown(timeout=2)
        try:
            from multiprocessing import resource_tracker
            resource_tracker._resource_tracker._stop()
        except Exception:
            pass
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        say_fatal(reason)
        os._exit(code)

    async def watch_scheduler(self, timeout: float, on_stuck: Callable[[str], None]) -> None:
        """Call `on_stuck(message)` once when the scheduler stops answering for `timeout` seconds.
        Runs until cancelled or the scheduler is gone.

        Three ways it can stop answering: its process is frozen (stopped, or native code holding
        the GIL): its heartbeat goes silent, seen here, with a stack dump requested; one step runs
        too long: the scheduler's own watchdog dumps its stack and exits, and the child watchdog
        reports that; replies stop arriving (the detokenizer or a socket): a load query that gets
        no answer within `timeout` plus a grace for the scheduler's own report to come first."""
        interval = min(max(timeout / 4, 0.05), 1.0)
        probe_every = min(max(timeout / 4, 0.05), 5.0)
        loop = asyncio.get_running_loop()
        probe, probe_started = None, loop.time()
        try:
            while True:
                await asyncio.sleep(interval)
                silent = self.procs.silent_scheduler(timeout)
                if silent:
                    dumped = self.procs.dump_stacks(self.procs.heartbeats)
                    on_stuck(self._watchdog_message(timeout, silent + (" Its stack is in the log above."
                                                                       if dumped else "")))
                    return
                if probe is not None and probe.done():
                    if probe.result() is None:  # a child died: the child watchdog reports it
                        return
                    if probe.result() is False:
                        on_stuck(self._watchdog_message(timeout, "A load query got no reply: the detokenizer "
                                                                 "or a socket is stuck."))
                        return
                    probe = None
                if probe is None and loop.time() - probe_started >= probe_every:
                    probe, probe_started = loop.create_task(self._probe(timeout + PROBE_GRACE_S)), loop.time()
        finally:
            if probe is not None:
                probe.cancel()

    def _watchdog_message(self, timeout: float, detail: str) -> str:
        return (f"Scheduler watchdog: the scheduler did not answer for {timeout:g} s (--watchdog-timeout="
                f"{timeout:g}) with {len(self.tokenizer_manager.rid_to_state)} request(s) in flight. {detail} "
                f"Shutting the server down.")

    async def _probe(self, timeout: float) -> Optional[bool]:
        """True: the scheduler answered a load query within `timeout`; False: it did not; None: a
        child died meanwhile."""
        try:
            await asyncio.wait_for(self.tokenizer_manager.get_load(), timeout)
        except asyncio.TimeoutError:
            return False
        except RequestError:
            return None
        return True
