"""Running programs: one (`run_program`), many on a thread pool (`run_program_batch`), and the
tracing that finds a batch's constant prefix so it is prefilled once before the programs start."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Union

from srt.lang.backend.base_backend import BaseBackend
from srt.lang.interpreter import StreamExecutor
from srt.lang.program_state import ProgramState

logger = logging.getLogger(__name__)
_default_backend: Optional[BaseBackend] = None
MIN_CACHED_PREFIX_CHARS = 64  # shorter constant prefixes are not worth a request (SGLang's threshold)


def set_default_backend(backend) -> None:
    """The backend programs use when `run` gets none (None clears it)."""
    global _default_backend
    _default_backend = resolve_backend(backend) if backend is not None else None


def get_default_backend() -> Optional[BaseBackend]:
    return _default_backend


def resolve_backend(backend) -> BaseBackend:
    """A backend object; our in-process `Engine` is wrapped on first use."""
    backend = backend if backend is not None else _default_backend
    if backend is None:
        raise ValueError("No backend: pass backend=sgl.RuntimeEndpoint(url) (or an Engine), "
                         "or call sgl.set_default_backend(...) first.")
    if isinstance(backend, BaseBackend):
        return backend
    if hasattr(backend, "tokenizer_manager") and hasattr(backend, "generate"):
        wrapped = getattr(backend, "_lang_backend", None)
        if wrapped is None:
            from srt.lang.backend.engine_backend import EngineBackend

            wrapped = backend._lang_backend = EngineBackend(backend)
        return wrapped
    raise TypeError(f"{type(backend).__name__} is not a backend: use sgl.RuntimeEndpoint(url) or an srt Engine")


def _start(program, backend, kwargs, defaults, stream, use_thread=True):
    arguments = {**program.bind_arguments, **kwargs}
    return ProgramState(StreamExecutor(backend, arguments, defaults, stream, use_thread)), arguments


def run_program(program, backend, args, kwargs, defaults, stream: bool):
    backend = resolve_backend(backend)
    state, arguments = _start(program, backend, kwargs, defaults, stream)
    if stream:
        import threading

        threading.Thread(target=_run_body, args=(program, state, args, arguments, True), daemon=True).start()
        return state
    _run_body(program, state, args, arguments, False)
    return state


def _run_body(program, state: ProgramState, args, arguments, capture: bool) -> None:
    exe = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **arguments)
    except Exception as exc:
        if not capture:
            raise
        logger.warning("Program %s failed: %s: %s", program.func.__name__, type(exc).__name__, exc)
        exe.sync()
        if exe.error_ is None:
            exe.error_ = exc
        exe._release_all()
    finally:
        exe.end()


def run_program_batch(program, backend, batch: List[Dict[str, Any]], defaults, num_threads: Union[int, str],
                      progress_bar: bool, generator_style: bool = False):
    backend = resolve_backend(backend)
    if len(batch) > 1:
        prefix = constant_prefix(program, backend, batch[:2], defaults)
        if len(prefix) > MIN_CACHED_PREFIX_CHARS:
            backend.cache_prefix(prefix)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch) or 1))

    def one(kwargs: Dict[str, Any]) -> ProgramState:
        state, arguments = _start(program, backend, kwargs, defaults, False)
        _run_body(program, state, (), arguments, True)  # a failing program is reported in its own state
        state.sync()
        return state

    pool = ThreadPoolExecutor(num_threads, thread_name_prefix="sgl-batch")
    futures = [pool.submit(one, kwargs) for kwargs in batch]
    pool.shutdown(wait=False)
    bar = None
    if progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=len(batch))
        for f in futures:
            f.add_done_callback(lambda _: bar.update(1))

    def results():
        try:
            for f in futures:
                yield f.result()
        finally:
            if bar is not None:
                bar.close()

    return results() if generator_style else list(results())


class _StopTrace(BaseException):
    """Raised by the tracing backend at the first model call (BaseException: programs catching
    Exception do not swallow it)."""


class _TraceBackend(BaseBackend):
    def __init__(self, inner: BaseBackend):
        self.inner = inner

    def get_chat_template(self):
        return self.inner.get_chat_template()

    def _generate(self, body):
        raise _StopTrace

    def _generate_stream(self, body):
        raise _StopTrace


def trace_prefix(program, backend: BaseBackend, kwargs: Dict[str, Any], defaults) -> str:
    """The text a program writes before its first model call (run in place, no thread, no request)."""
    state, arguments = _start(program, _TraceBackend(backend), kwargs, defaults, False, use_thread=False)
    exe = state.stream_executor
    exe.get_var = _stop_on_read(exe.get_var)
    try:
        program.func(state, **arguments)
    except (_StopTrace, Exception):
        pass
    return exe.text_


def _stop_on_read(get_var):
    def wrapped(name):
        if name not in get_var.__self__.variables:
            raise _StopTrace
        return get_var(name)
    return wrapped


def constant_prefix(program, backend: BaseBackend, batch: List[Dict[str, Any]], defaults) -> str:
    """The text every traced program of `batch` starts with (empty when they differ at once)."""
    texts = [trace_prefix(program, backend, kwargs, defaults) for kwargs in batch]
    return os.path.commonprefix(texts) if texts else ""
