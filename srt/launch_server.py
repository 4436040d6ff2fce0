"""`launch_server` / `python -m srt.launch_server`: parse the flags, check the port, start the runtime,
serve HTTP, warm up, and shut everything down on Ctrl-C / SIGTERM or when a runtime child dies.

SIGTERM drains: new requests get 503 while in-flight ones finish for --graceful-shutdown-timeout
seconds; what is left then (or at once on Ctrl-C or a second signal) fails with 503 and its reason.

Only light modules are imported before the port check, so a taken port is reported in well under
a second, before any model or torch import.
"""

from __future__ import annotations

import errno
import gc
import logging
import signal
import socket
import sys
from typing import List, Optional

from srt.check_config import add_check_args, run_check  # light: its heavy imports wait for a dry run
from srt.server_args import ServerArgs, make_parser
from srt.utils.logging_utils import say_fatal

logger = logging.getLogger("srt.launch_server")  # also when run as __main__

WARMUP_TEXT = "The capital city of France is"


def port_problem(host: str, port: int) -> Optional[str]:
    """None when `host:port` can be bound now, else a one-line message saying what to do."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"Cannot resolve --host {host!r}: {exc.strerror}. Pass an address such as 127.0.0.1 or 0.0.0.0."
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
            try:
                sock.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (f"Address already in use: {host}:{port} is taken by another process. "
                            f"Stop it or pass --port <other>{_free_port_hint(host, port)}.")
                return f"Cannot listen on {host}:{port}: {exc.strerror}. Check --host and --port."
    return None


def _free_port_hint(host: str, port: int) -> str:
    for candidate in range(port + 1, min(port + 50, 65536)):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, candidate))
            except OSError:
                continue
        return f" (for example --port {candidate}, which is free now)"
    return ""


def main(argv: Optional[List[str]] = None) -> None:
    parser = make_parser(prog="launch_server")
    parser.add_argument("--dry-run", action="store_true",
                        help="Run the start-up checks and the KV-pool arithmetic without loading weights or "
                        "starting a server, print them and exit (as python -m srt.check_config).")
    add_check_args(parser)
    args = parser.parse_args(argv)
    if args.dry_run:
        sys.exit(run_check(args))
    if args.json or args.target_input_len is not None:
        _fail("--json and --target-input-len only apply with --dry-run (or python -m srt.check_config).")
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as exc:
        _fail(str(exc))
    from srt.utils.logging_utils import configure_logging

    configure_logging(server_args.log_level)
    if args.api_key:
        logger.warning("--api-key on the command line is readable by every local user (/proc/<pid>/cmdline); "
                       "prefer --api-key-file or $SRT_API_KEY.")
    if server_args.node_rank > 0:  # no HTTP server here: this node only runs its TP ranks
        sys.exit(run_worker_node(server_args))
    problem = port_problem(server_args.host, server_args.port)
    if problem:
        _fail(problem)
    sys.exit(run_server(server_args))


def _fail(message: str, code: int = 1) -> None:
    say_fatal(message)
    sys.exit(code)


def run_server(server_args: ServerArgs) -> int:
    """Start the runtime and serve until stopped; returns the exit code. Start-up failures print
    their root cause as one line (no traceback wall)."""
    import asyncio

    from srt.entrypoints.frontend import RuntimeFrontend

    # Until the event loop takes over, SIGTERM unwinds like Ctrl-C so the children are stopped.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    frontend = None
    try:
        frontend = RuntimeFrontend(server_args)
        frontend.start()
    except (ValueError, RuntimeError, OSError) as exc:
        logger.debug("start-up failed", exc_info=True)
        if frontend is not None:  # children that did start say goodbye before the cause is printed
            frontend.shutdown()
        # ValueError / RuntimeError carry our own texts (bad path, tokenizer, a child's root cause).
        say_fatal(str(exc) if isinstance(exc, (ValueError, RuntimeError)) else f"{type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        if frontend is not None:
            frontend.shutdown()
        say_fatal("Interrupted during start-up.")
        return 130
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(_serve(frontend, server_args))
    finally:
        frontend.shutdown()
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run_worker_node(server_args: ServerArgs) -> int:
    """Node `--node-rank` > 0: start this node's TP ranks and wait. Ends when node 0 stops the group
    (exit 0), when a rank here fails or loses a peer (exit 1, its error last), or on Ctrl-C / SIGTERM."""
    import threading

    from srt.entrypoints.process_launcher import RuntimeProcesses

    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    procs = RuntimeProcesses(server_args)
    try:
        procs.start()
    except (ValueError, RuntimeError, OSError) as exc:
        say_fatal(str(exc))
        return 1
    except KeyboardInterrupt:
        procs.shutdown()
        return 130
    per_node = server_args.tp_size // server_args.nnodes
    first = server_args.node_rank * per_node
    logger.info("Node %d: TP ranks %d..%d ready, joined the group at %s (node 0 serves HTTP).",
                server_args.node_rank, first, first + per_node - 1, server_args.dist_init_addr)
    ended, reason = threading.Event(), []
    procs.watch(lambda why: (reason.append(why), ended.set()))
    try:
        while not ended.wait(0.5):
            pass
    except KeyboardInterrupt:
        procs.shutdown()
        return 0
    codes = [p.exitcode for p in procs.procs.values()]
    procs.shutdown(timeout=2)
    if all(code == 0 for code in codes if code is not None) and "exited unexpectedly with code 0" in reason[0]:
        logger.info("Node 0 stopped the TP group; node %d exits.", server_args.node_rank)
        return 0
    say_fatal(reason[0])
    return 1


def _raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _new_event_loop():
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _serve(frontend, server_args: ServerArgs) -> int:
    import asyncio

    from aiohttp import web

    from srt.entrypoints.connection_guard import ConnectionGuard
    from srt.entrypoints.http_server import create_app
    from srt.entrypoints.server_state import ServerState

    loop = asyncio.get_running_loop()
    tm = await frontend.connect()
    state = ServerState(server_args=server_args, tokenizer_manager=tm, scheduler_info=frontend.scheduler_info,
                        model_name=server_args.served_model_name or server_args.model_path,
                        processes=frontend.procs)
    frontend.procs.watch(lambda reason: _on_child_death(frontend, state, loop, reason))
    stop, abort_now, signals = asyncio.Event(), asyncio.Event(), []

    def on_signal(sig: int) -> None:  # SIGTERM drains; Ctrl-C or a second signal aborts at once
        signals.append(sig)
        stop.set()
        if sig == signal.SIGINT or len(signals) > 1:
            abort_now.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    guard = ConnectionGuard.for_server(server_args)
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None, shutdown_timeout=3.0,
                           keepalive_timeout=server_args.http_keepalive_timeout)
    await runner.setup()
    host, port = server_args.host, server_args.port
    try:
        await guard.site(runner, host, port).start()
    except OSError as exc:  # taken between the early check and now
        await runner.cleanup()
        await frontend.close()
        frontend.shutdown()  # the children's last words come first: the cause is the last line
        say_fatal(port_problem(host, port) or f"Cannot listen on {host}:{port}: {exc.strerror or exc}.")
        return 1
    watchdog = None
    if server_args.watchdog_timeout > 0:
        watchdog = loop.create_task(frontend.watch_scheduler(
            server_args.watchdog_timeout, lambda reason: _on_stuck(frontend, state, reason)))
    error = None if server_args.skip_server_warmup else await _warm_up(tm, stop)
    if error:
        stop.set()
    if not stop.is_set():
        # Start-up's objects (model config, tokenizer, template, aiohttp) never die: moved out of
        # the collector's generations, a full collection no longer walks them on the event loop.
        gc.collect()
        gc.freeze()
        state.ready = True
        logger.info("The server is fired up and ready to roll! URL: http://%s:%d", _url_host(host), port)
    await stop.wait()
    logger.info("Shutting down.")
    state.ready, state.shutting_down = False, True
    await _drain(tm, server_args.graceful_shutdown_timeout, abort_now)
    if watchdog is not None:
        watchdog.cancel()
    await runner.cleanup()
    guard.close()
    await frontend.close()
    frontend.shutdown()
    if error:  # the cause is the last line printed
        say_fatal(error)
        return 1
    return 0


async def _drain(tm, timeout: float, abort_now) -> None:
    """Let in-flight requests finish for `timeout` seconds (sooner when `abort_now` is set), then
    fail the rest with 503 and the reason, and have the scheduler drop them."""
    import asyncio

    loop = asyncio.get_running_loop()
    waited = 0.0
    if tm.rid_to_state and timeout > 0 and not abort_now.is_set():
        logger.info("Draining %d in-flight request(s) for up to %g s (--graceful-shutdown-timeout); new requests "
                    "get 503. Send the signal again to abort them now.", len(tm.rid_to_state), timeout)
        start = loop.time()
        while tm.rid_to_state and not abort_now.is_set() and loop.time() - start < timeout:
            try:
                await asyncio.wait_for(abort_now.wait(), 0.05)
            except asyncio.TimeoutError:
                pass
        waited = loop.time() - start
    if tm.rid_to_state:
        why = (f"after waiting {waited:.0f} s (--graceful-shutdown-timeout={timeout:g})" if not abort_now.is_set()
               else "without waiting further (Ctrl-C or a second signal)")
        reason = f"The server is shutting down: the request was aborted {why}."
        logger.warning("Aborting %d request(s) still in flight %s.", len(tm.rid_to_state), why)
        tm.fail_all(reason)  # each consumer gets 503 and the reason: never a 200 with partial text
    elif waited:
        logger.info("Every in-flight request finished.")
    await tm.abort_request(abort_all=True)  # the scheduler drops whatever it still runs


async def _warm_up(tm, stop) -> Optional[str]:
    """One short greedy generation through the whole stack; the error text when it fails."""
    import asyncio

    from managers.generate_input import GenerateReqInput, RequestError

    obj = GenerateReqInput(text=WARMUP_TEXT, rid="WARMUP_REQUEST",
                           sampling_params={"max_new_tokens": 4, "temperature": 0})

    async def run() -> None:
        async for _ in tm.generate_request(obj):
            pass

    task = asyncio.ensure_future(run())
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
    if not task.done():  # stopped during warm-up
        task.cancel()
        return None
    try:
        task.result()
    except RequestError as exc:
        return f"Warm-up request failed: {exc.message}"
    return None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _on_child_death(frontend, state, loop, reason: str) -> None:
    """Watchdog thread: fail the in-flight requests, then exit with the cause as the last line."""
    import time

    state.dead_reason, state.ready = reason, False
    logger.error("%s", reason)
    try:
        loop.call_soon_threadsafe(state.tokenizer_manager.fail_all, reason)
        time.sleep(0.2)  # let the 503s go out
    except RuntimeError:  # the loop is already closed
        pass
    frontend.exit_with(reason)


def _on_stuck(frontend, state, reason: str) -> None:
    """Event loop: the scheduler stopped answering. Fail the in-flight requests, then exit."""
    import asyncio

    state.dead_reason, state.ready = reason, False
    logger.error("%s", reason)
    state.tokenizer_manager.fail_all(reason)
    asyncio.get_running_loop().call_later(0.2, frontend.exit_with, reason)


if __name__ == "__main__":
    main()
