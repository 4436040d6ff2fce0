"""`Engine`: the runtime in-process, without HTTP (scripts, notebooks, benchmarks, the DSL).

The engine owns an asyncio loop in a background thread, so its blocking methods work from
plain scripts, from code already inside an event loop, and in Jupyter. Scheduler and
detokenizer run as subprocesses, so shutting an engine down returns all of its memory and a
second engine in the same process gets the full budget.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Union

from managers.generate_input import GenerateReqInput
from srt.entrypoints.frontend import RuntimeFrontend
from srt.server_args import ServerArgs
from srt.utils.logging_utils import configure_logging

logger = logging.getLogger(__name__)
_DONE = object()


class EngineDeadError(RuntimeError):
    """A runtime subprocess died; the message is its root cause."""


class Engine:
    def __init__(self, exit_on_child_death: bool = False, log_level: Optional[str] = None, **kwargs: Any):
        configure_logging(log_level)
        if log_level is not None:
            kwargs["log_level"] = log_level  # the children configure their logging from the args
        self.server_args = ServerArgs(**kwargs)
        self.frontend = RuntimeFrontend(self.server_args)  # checks the model path before any process starts
        self.exit_on_child_death = exit_on_child_death
        self.dead_reason: Optional[str] = None
        self._closed = False
        self.procs = self.frontend.procs
        self.scheduler_info = self.frontend.start()
        try:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name="srt-engine-loop", daemon=True)
            self._thread.start()
            self.tokenizer_manager = self._call(self.frontend.connect())
        except BaseException:
            self.procs.shutdown()
            raise
        self.procs.watch(self._on_child_death)
        atexit.register(self.shutdown)
        logger.info("Engine ready: %s", self.get_server_info()["limits"])

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro):
        """Run `coro` on the engine loop and wait for it from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("The engine was shut down.")
        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)

    def _on_child_death(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s", reason)
        if self.exit_on_child_death:
            self.frontend.exit_with(reason)
        fail = getattr(self.tokenizer_manager, "fail_all", None)
        if fail is not None:
            self.loop.call_soon_threadsafe(fail, reason)

    @staticmethod
    def _request(prompt, sampling_params, input_ids, stream, **kw) -> GenerateReqInput:
        kw = {k: v for k, v in kw.items() if v is not None}
        return GenerateReqInput(text=prompt, input_ids=input_ids, sampling_params=sampling_params, stream=stream, **kw)

    # ------------------------------------------------------------------ public API
    def generate(self, prompt: Union[str, List[str], None] = None, sampling_params: Union[Dict, List[Dict], None] = None,
                 input_ids: Union[List[int], List[List[int]], None] = None, stream: bool = False,
                 **kwargs: Any) -> Union[Dict, List[Dict], Iterator[Dict]]:
        """Blocking generate. `kwargs`: return_logprob, logprob_start_len, top_logprobs_num,
        return_text_in_logprobs, token_ids_logprob, rid. With `stream=True` returns an iterator of
        cumulative updates (closing it aborts the request)."""
        self._check_alive()
        obj = self._request(prompt, sampling_params, input_ids, stream, **kwargs)
        if not stream:
            return self._call(self._final(obj))
        return self._sync_stream(obj)

    async def _final(self, obj: GenerateReqInput):
        last = None
        async for out in self.tokenizer_manager.generate_request(obj):
            last = out
        return last

    def _sync_stream(self, obj: GenerateReqInput) -> Iterator[Dict]:
        q: "queue.Queue" = queue.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate_request(obj):
                    q.put(out)
            except BaseException as e:  # delivered to the consumer thread
                q.put(e)
            finally:
                q.put(_DONE)

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item = q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()  # consumer stopped early: the tokenizer manager aborts the request

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False,
                             **kwargs: Any) -> Union[Dict, List[Dict], AsyncIterator[Dict]]:
        """Awaitable generate for code running its own event loop."""
        self._check_alive()
        obj = self._request(prompt, sampling_params, input_ids, stream, **kwargs)
        if not stream:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._final(obj), self.loop))
        return self._async_stream(obj)

    async def _async_stream(self, obj: GenerateReqInput) -> AsyncIterator[Dict]:
        caller = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in self.tokenizer_manager.generate_request(obj):
                    caller.call_soon_threadsafe(q.put_nowait, out)
            except BaseException as e:
                caller.call_soon_threadsafe(q.put_nowait, e)
            finally:
                caller.call_soon_threadsafe(q.put_nowait, _DONE)

        fut = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while True:
                item = await q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()

    def flush_cache(self):
        self._check_alive()
        return self._call(self.tokenizer_manager.flush_cache())

    def get_load(self):
        self._check_alive()
        return self._call(self.tokenizer_manager.get_load())

    def get_server_info(self) -> Dict[str, Any]:
        info = self.scheduler_info
        return {
            "server_args": dict(vars(self.server_args)),
            "limits": {
                "max_total_num_tokens": info.max_total_num_tokens, "max_req_input_len": info.max_req_input_len,
                "max_running_requests": info.max_running_requests, "context_length": info.context_len,
            },
            "kv_budget": info.kv_budget,
            "pids": self.procs.pids(),
        }

    def shutdown(self) -> None:
        """Stop the subprocesses and the loop thread; remove the socket directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.procs.shutdown()
        if getattr(self, "loop", None) is not None and self.loop.is_running():
            try:
                self._call(self.frontend.close())
            except Exception:  # the loop may already be closing at interpreter exit
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
        atexit.unregister(self.shutdown)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
