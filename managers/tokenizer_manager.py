"""TokenizerManager: the main process's side of a request (asyncio, no sockets of its own).

It bounds a request (--max-batch-items, --max-n), tokenizes it (off the event loop for long texts
and big batches, stopping early once a prompt is certainly over the context length), validates
against `RequestLimits` before anything reaches the scheduler, keeps `rid -> ReqState`, turns
detokenized updates into response dicts, and aborts requests whose consumer went away. The caller
wires IPC: `send_to_scheduler` out, and `handle_batch_str_out` / `handle_reply` in, called from a
task on the same event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Deque, Dict, List, Optional, Tuple

from managers.finish_reason import is_queue_full
from managers.generate_input import GenerateReqInput, GenerateReqItem, RequestError, RequestLimits
from managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetLoadReqInput,
    GetLoadReqOutput,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from managers.data_parallel_controller import merge_flushes, merge_loads
from managers.prompt_tokenizer import Encoded, PromptTokenizer
from managers.req_output_accumulator import ReqOutput
from managers.request_bounds import CONTEXT_CODE, RequestBounds, server_flag
from managers.template_manager import TemplateManager
from managers.tokenizer_metrics import TokenizerMetrics
from srt.constrained.base_grammar_backend import GrammarError, create_grammar_backend, grammar_key
from srt.sampling.sampling_params import SamplingParams

__all__ = ["RequestError", "ReqState", "TokenizerManager", "TokenizerMetrics"]

logger = logging.getLogger(__name__)

ABORTED_BY_CLIENT = 499  # status of "Aborted by request." finishes: delivered, not raised
# An aborted request keeps its rid until the scheduler's finish for it came back (a new request
# with that rid would receive it), or for this long if that finish never comes.
DRAIN_TIMEOUT_S = 30.0


@dataclass
class _Sink:
    """Updates of one generate call in arrival order, drained by its consumer after each wake-up."""

    items: Deque[Tuple[int, Dict[str, Any]]] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class _Prepared:
    """A validated item ready to send, and the meta_info notes the front end adds to its outputs."""

    req: TokenizedGenerateReqInput
    meta_extra: Dict[str, Any]
    item: GenerateReqItem


@dataclass
class ReqState:
    """One rid in flight. `n` outputs land at flat indices `index_base .. index_base + n - 1` of
    the call's results; n > 1 children are found by (`parent_rid`, `index`), never by their own
    rid labels, so a client rid equal to a child's label (`rid-0`) is a different request."""

    rid: str
    item: GenerateReqItem
    n: int
    index_base: int
    sink: _Sink
    meta_extra: Dict[str, Any]
    created_time: float = field(default_factory=time.monotonic)
    finished: bool = False
    released_time: Optional[float] = None  # consumer gone before the finish: draining until it comes
    finished_children: set = field(default_factory=set)
    progress: Dict[int, Tuple[int, float]] = field(default_factory=dict)  # child -> (tokens, time)
    outputs: Dict[int, ReqOutput] = field(default_factory=dict)  # child -> what it has shown so far

    def output(self, child: int) -> ReqOutput:
        return self.outputs.setdefault(child, ReqOutput())

    @property
    def event(self) -> asyncio.Event:
        return self.sink.event


class TokenizerManager:
    """Turns `GenerateReqInput`s into scheduler requests and detokenized updates into responses."""

    def __init__(self, server_args: Any, tokenizer: Any, template_manager: Optional[TemplateManager],
                 scheduler_info: SchedulerReady, send_to_scheduler: Callable[[object], None],
                 dp_size: int = 1, on_release: Optional[Callable[[str], None]] = None):
        self.server_args = server_args
        self.dp_size = dp_size  # replicas answering each admin query
        self.on_release = on_release  # the data-parallel controller's bookkeeping
        self.tokenizer = tokenizer
        self.template_manager = template_manager
        self.scheduler_info = scheduler_info
        self.send = send_to_scheduler
        self.context_len = scheduler_info.context_len
        self.vocab_size = scheduler_info.vocab_size
        self.max_req_input_len = scheduler_info.max_req_input_len
        self.limits = RequestLimits.from_scheduler_info(scheduler_info)
        self.bounds = RequestBounds(server_args, self.limits, self.context_len, self.vocab_size)
        self.rid_to_state: Dict[str, ReqState] = {}
        self._draining: Dict[str, ReqState] = {}  # aborted rids whose finish has not come back
        self.metrics = TokenizerMetrics()
        self._pending: Dict[type, Deque[asyncio.Future]] = {FlushCacheReqOutput: deque(), GetLoadReqOutput: deque()}
        self._token_text: Dict[int, str] = {}
        self.prompts = PromptTokenizer(tokenizer, self.context_len, server_flag(server_args, "tokenizer_worker_threshold"))
        self._grammar_backend: Any = None

    # ------------------------------------------------------------------ public API
    async def generate_request(self, obj: GenerateReqInput) -> AsyncIterator[Any]:
        """Yield `{"text", "output_ids", "meta_info"}` dicts (text, ids and logprobs cumulative,
        rebuilt from the incremental updates).

        Single prompt, n == 1: stream -> one dict per update, the last one finished; else one dict.
        Batch or n > 1: stream -> per-output updates carrying "index"; else one list of dicts.
        Bad input raises `RequestError` on the first iteration, before anything is sent.
        """
        self.bounds.check_batch_size(obj)
        self.bounds.check_input_ids_lengths(obj)
        items = obj.normalize()
        self.bounds.check_fan_out(items)
        self.bounds.check_work_caps(items)
        self._check_rids([item.rid for item in items])
        prepared = await self._prepare_all(items)
        self._check_rids([p.req.rid for p in prepared])  # again: others may have registered meanwhile
        sink = _Sink()
        states = self._register(prepared, sink)
        flat_single = obj.is_single and states[0].n == 1
        try:
            async for out in self._wait(states, sink, obj.stream, flat_single):
                yield out
        finally:
            self._release(states)

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort `rid` (and its n > 1 children); its consumer receives an abort finish reason."""
        self.send(AbortReq(rid=rid, abort_all=abort_all))

    async def flush_cache(self) -> FlushCacheReqOutput:
        replies = await self._request_replies(FlushCacheReqInput(), FlushCacheReqOutput)
        return replies[0] if len(replies) == 1 else merge_flushes(replies)

    async def get_load(self) -> GetLoadReqOutput:
        """The scheduler's load; with data parallelism, totals with each replica in `replicas`."""
        replies = await self._request_replies(GetLoadReqInput(), GetLoadReqOutput)
        return replies[0] if len(replies) == 1 else merge_loads(replies)

    async def encode_prompt(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """A rendered prompt's ids (the chat endpoint), bounded like `/generate`'s texts: one that is
        certainly over the context length is refused here, after tokenizing a prefix of it (with
        --allow-auto-truncate, that prefix is returned and truncated later like any input)."""
        enc = await self.prompts.encode(text, add_special_tokens)
        if not enc.complete and not getattr(self.server_args, "allow_auto_truncate", False):
            raise self.bounds.too_long(enc)
        return enc.ids

    def chat_to_prompt(self, messages: Any, **template_kwargs: Any) -> str:
        """Apply the chat template (400 `RequestError` when there is none or the messages are bad)."""
        if self.template_manager is None:
            raise RequestError("This server has no chat template manager; pass --chat-template.", 400)
        return self.template_manager.apply(messages, **template_kwargs)

    def fail_all(self, reason: str) -> None:
        """A child process died: every in-flight request and admin call fails with 503 and `reason`."""
        finish = {"type": "abort", "message": reason, "status_code": 503}
        now = time.monotonic()
        self._draining.clear()
        for state in list(self.rid_to_state.values()):
            for child in range(state.n):
                self._deliver(state, child, finish, {}, now)
        for waiting in self._pending.values():
            while waiting:
                future = waiting.popleft()
                if not future.done():
                    future.set_exception(RequestError(reason, 503, code="service_unavailable"))

    def close(self) -> None:
        self.prompts.close()

    # ------------------------------------------------------------------ inbound messages
    def handle_batch_str_out(self, msg: BatchStrOut) -> None:
        """Route each update to its state; unknown rids belong to aborted requests and are dropped.
        Each piece is written at its offset into the output it belongs to, then delivered whole."""
        now = time.monotonic()
        for i, rid in enumerate(msg.rids):
            meta = msg.meta_info[i] if i < len(msg.meta_info) else {}
            state, child = self._find_state(rid, meta)
            if state is None:
                continue
            finish = msg.finished_reasons[i]
            # A refusal of an n > 1 request before its fan-out arrives under the parent rid.
            children = range(state.n) if state.n > 1 and "parent_rid" not in meta else (child,)
            if state.released_time is not None:
                self._drain(state, children, finish)
                continue
            text_offset, ids_offset = _item(msg.text_offsets, i, 0), _item(msg.output_offsets, i, 0)
            for c in children:
                if c in state.finished_children:
                    continue
                meta_out = {k: v for k, v in meta.items() if k != "parent_rid"}
                state.output(c).add(msg.texts[i], text_offset, msg.output_ids[i], ids_offset, meta_out,
                                    self._converter(state))
                self._deliver(state, c, finish, meta_out, now)

    def handle_reply(self, msg: Any) -> None:
        """Resolve the oldest pending flush_cache / get_load call waiting for this reply type."""
        if isinstance(msg, BatchStrOut):
            self.handle_batch_str_out(msg)
            return
        waiting = self._pending.get(type(msg))
        if not waiting:
            logger.warning("Dropping unexpected %s (no caller is waiting for it).", type(msg).__name__)
            return
        future = waiting.popleft()
        if not future.done():  # a caller that timed out still consumes its own reply
            future.set_result(msg)

    # ------------------------------------------------------------------ bounds of one request
    # ------------------------------------------------------------------ preparing requests
    async def _prepare_all(self, items: List[GenerateReqItem]) -> List[_Prepared]:
        """Every item checked and tokenized; the first bad one refuses the whole call."""
        params = [self._sampling_params(item) for item in items]
        for sampling_params in params:
            await self._check_grammar(sampling_params)
        texts = [item.text for item in items if item.input_ids is None]
        encoded = iter(await self.prompts.encode_many(texts))
        return [self._prepare(item, sp, None if item.input_ids is not None else next(encoded))
                for item, sp in zip(items, params)]

    def _sampling_params(self, item: GenerateReqItem) -> SamplingParams:
        try:
            sampling_params = SamplingParams.from_dict(item.sampling_params)
            sampling_params.verify(self.vocab_size)
        except ValueError as exc:
            raise RequestError(str(exc), 400, code="invalid_request_error", param="sampling_params") from None
        if item.data_parallel_rank is not None and item.data_parallel_rank >= self.dp_size:
            raise RequestError(f"data_parallel_rank must be in [0, {self.dp_size}) for this server (--dp-size "
                               f"{self.dp_size}), got {item.data_parallel_rank}.", 400,
                               code="invalid_request_error", param="data_parallel_rank")
        return sampling_params

    def _prepare(self, item: GenerateReqItem, sampling_params: SamplingParams, enc: Optional[Encoded]) -> _Prepared:
        if item.input_ids is not None:
            self.bounds.check_token_ids(item.input_ids, "input_ids")
            enc = Encoded(item.input_ids)
        elif not enc.ids:
            raise RequestError("The text tokenized to zero tokens: send a non-empty prompt.", 400)
        if item.token_ids_logprob:
            self.bounds.check_token_ids(item.token_ids_logprob, "token_ids_logprob")
        raw = item.sampling_params
        explicit_max_new = isinstance(raw, dict) and raw.get("max_new_tokens") is not None
        ids, meta_extra = self.bounds.check_context(enc, sampling_params, explicit_max_new, item.rid)
        if item.return_logprob and item.logprob_start_len is not None and item.logprob_start_len >= len(ids):
            raise RequestError(f"logprob_start_len ({item.logprob_start_len}) must be smaller than the input length "
                               f"({len(ids)} tokens); use -1 for output logprobs only.", 400,
                               code="invalid_request_error", param="logprob_start_len")
        try:
            sampling_params.normalize(self.tokenizer)
        except ValueError as exc:
            raise RequestError(str(exc), 400, code="invalid_request_error", param="sampling_params") from None
        req = TokenizedGenerateReqInput(
            rid=item.rid, input_ids=ids, sampling_params=sampling_params, input_text=item.text,
            return_logprob=item.return_logprob, logprob_start_len=item.logprob_start_len,
            top_logprobs_num=item.top_logprobs_num, token_ids_logprob=item.token_ids_logprob,
            stream=item.stream, extra_key=item.extra_key, data_parallel_rank=item.data_parallel_rank)
        return _Prepared(req, meta_extra, item)

    def _check_rids(self, rids: List[str]) -> None:
        now = time.monotonic()
        for rid in rids:
            if rid in self.rid_to_state:
                raise RequestError(f"Duplicate request id {rid!r}: a request with this rid is still running.",
                                   400, code="invalid_request_error", param="rid")
            draining = self._draining.get(rid)
            if draining is not None and now - draining.released_time < DRAIN_TIMEOUT_S:
                raise RequestError(f"Duplicate request id {rid!r}: the request with this rid was aborted and the "
                                   f"scheduler has not confirmed it yet; retry in a moment or use another rid.",
                                   400, code="invalid_request_error", param="rid")
            if draining is not None:
                logger.warning("Request %s: no finish came back %.0f s after its abort; releasing the rid.",
                               rid, DRAIN_TIMEOUT_S)
                del self._draining[rid]

    # ------------------------------------------------------------------ state bookkeeping
    def _register(self, prepared: List[_Prepared], sink: _Sink) -> List[ReqState]:
        states, base = [], 0
        for p in prepared:
            state = ReqState(p.req.rid, p.item, p.req.sampling_params.n, base, sink, p.meta_extra)
            base += state.n
            states.append(state)
        for state, p in zip(states, prepared):
            self.rid_to_state[state.rid] = state  # before sending: an in-process scheduler may answer at once
            self.metrics.num_requests += 1
            self.send(p.req)
        return states

    def _release(self, states: List[ReqState]) -> None:
        """Drop the call's states; abort those the scheduler is still working on (consumer gone):
        their rids stay taken (`_draining`) until the scheduler's finish for them comes back."""
        for state in states:
            if self.rid_to_state.get(state.rid) is state:
                del self.rid_to_state[state.rid]
            if self.on_release is not None:
                self.on_release(state.rid)
            if not state.finished:
                self.send(AbortReq(rid=state.rid))
                self.metrics.num_aborted += 1
                state.released_time = time.monotonic()
                self._draining[state.rid] = state

    def _drain(self, state: ReqState, children: Any, finish: Optional[Dict[str, Any]]) -> None:
        """An update for an aborted request nobody waits for: count its finishes, free its rid."""
        if finish is not None:
            state.finished_children.update(children)
        if len(state.finished_children) == state.n and self._draining.get(state.rid) is state:
            del self._draining[state.rid]

    def _find_state(self, rid: str, meta: Dict[str, Any]) -> Tuple[Optional[ReqState], int]:
        """The state an update belongs to: its own rid, or for an n > 1 child its parent's (the
        child's rid is a label that another client's rid may equal)."""
        parent = meta.get("parent_rid")
        key = rid if parent is None else parent
        state = self.rid_to_state.get(key) or self._draining.get(key)
        if state is None or parent is None:
            return state, 0
        index = meta.get("index", 0)
        if not 0 <= index < state.n:
            logger.warning("Dropping update for %s: child index %s outside n=%d.", rid, index, state.n)
            return None, 0
        return state, index

    def _deliver(self, state: ReqState, child: int, finish: Optional[Dict[str, Any]], meta_out: Dict[str, Any],
                 now: float) -> None:
        """Hand `child`'s cumulative output to its consumer; `meta_out` has cumulative logprobs."""
        if child in state.finished_children:
            return
        output = state.output(child)
        meta_out.setdefault("id", state.rid if state.n == 1 else f"{state.rid}-{child}")
        meta_out.update(state.meta_extra)
        meta_out["finish_reason"] = finish = _explain_clamp(finish, state.meta_extra)
        meta_out["e2e_latency"] = now - state.created_time
        out = {"text": output.text, "output_ids": list(output.output_ids), "meta_info": meta_out}
        tokens = int(meta_out.get("completion_tokens", len(output.output_ids)))
        self._observe(state, child, tokens, now, finish is not None)
        state.sink.items.append((state.index_base + child, out))
        state.sink.event.set()
        if finish is None:
            return
        state.finished_children.add(child)
        m = self.metrics
        m.num_finished += 1
        m.num_aborted += finish.get("type") == "abort" and not is_queue_full(finish)
        m.prompt_tokens += int(meta_out.get("prompt_tokens", 0))
        m.generation_tokens += tokens
        m.cached_tokens += int(meta_out.get("cached_tokens", 0))
        if len(state.finished_children) == state.n:
            state.finished = True
            if self.rid_to_state.get(state.rid) is state:
                del self.rid_to_state[state.rid]

    def _observe(self, state: ReqState, child: int, tokens: int, now: float, finished: bool) -> None:
        if finished:
            self.metrics.e2e_latency.observe(now - state.created_time)
        if not state.item.stream or tokens <= 0:
            return  # without streaming only the final update arrives: no per-token timing
        prev_tokens, prev_time = state.progress.get(child, (0, state.created_time))
        if prev_tokens == 0:
            self.metrics.time_to_first_token.observe(now - state.created_time)
        elif tokens > prev_tokens:
            self.metrics.inter_token_latency.observe((now - prev_time) / (tokens - prev_tokens))
        if tokens > prev_tokens:
            state.progress[child] = (tokens, now)

    # ------------------------------------------------------------------ waiting and responses
    async def _wait(self, states: List[ReqState], sink: _Sink, stream: bool,
                    flat_single: bool) -> AsyncIterator[Any]:
        total = sum(state.n for state in states)
        finals: Dict[int, Dict[str, Any]] = {}
        while len(finals) < total:
            while not sink.items:
                sink.event.clear()
                await sink.event.wait()
            index, out = sink.items.popleft()
            finish = out["meta_info"]["finish_reason"]
            _raise_if_refused(finish)
            if finish is not None:
                finals[index] = out
            if stream:
                yield out if flat_single else {**out, "index": index}
        if not stream:
            yield finals[0] if flat_single else [finals[i] for i in range(total)]

    async def _check_grammar(self, sampling_params: SamplingParams) -> None:
        """A grammar that does not compile is a 400 naming its field, before anything is sent; other failures: 500."""
        if (key := grammar_key(sampling_params)) is None:
            return
        try:
            name = getattr(self.server_args, "grammar_backend", "llguidance")
            self._grammar_backend = self._grammar_backend or create_grammar_backend(name, self.tokenizer, self.vocab_size)
            await asyncio.wrap_future(self._grammar_backend.get_future(key))
        except GrammarError as exc:
            raise RequestError(str(exc), 400, code="invalid_request_error",
                               param=f"sampling_params.{exc.field}") from None
        except Exception as exc:  # the backend's fault, never blamed on the client's grammar
            logger.exception("The grammar backend failed on a %s constraint", key[0])
            raise RequestError(f"Internal error compiling the {key[0]} constraint: {exc!r}", 500, code="internal_error")

    async def _request_replies(self, request: Any, reply_type: type) -> List[Any]:
        """Send an admin query and wait for its reply from every data-parallel replica."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(self.dp_size)]
        self._pending[reply_type].extend(futures)
        self.send(request)
        return list(await asyncio.gather(*futures))

    def _converter(self, state: ReqState) -> Callable[[List[Any]], List[Any]]:
        """Logprob entries become `[logprob, token_id, text|None]` (text only with return_text_in_logprobs)."""
        with_text = state.item.return_text_in_logprobs
        return lambda entry: self._entry(entry, with_text)

    def _entry(self, entry: List[Any], with_text: bool) -> List[Any]:
        logprob, tid = entry[0], int(entry[1])
        return [logprob, tid, self._decode_token(tid) if with_text else None]

    def _decode_token(self, tid: int) -> str:
        text = self._token_text.get(tid)
        if text is None:
            text = self.tokenizer.decode([tid])
            self._token_text[tid] = text
        return text


def _item(values: List[Any], i: int, default: Any) -> Any:
    """Offsets of `BatchStrOut` may be left empty by the sender (0: a cumulative update)."""
    return values[i] if i < len(values) else default


def _explain_clamp(finish: Optional[Dict[str, Any]], meta_extra: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A request that stopped at a clamped max_new_tokens says so in its finish reason."""
    clamp = meta_extra.get("max_new_tokens_clamped")
    if not finish or not clamp or finish.get("type") != "length" or finish.get("length") != clamp["used"]:
        return finish
    return {**finish, "message": f"Stopped at max_new_tokens={clamp['used']}, clamped from the requested "
                                 f"{clamp['requested']}: {clamp['reason']}."}


def _raise_if_refused(finish: Optional[Dict[str, Any]]) -> None:
    """Scheduler refusals (400, 503, ...) become errors; a client abort (499) is a normal finish."""
    if not finish or finish.get("type") != "abort":
        return
    status = finish.get("status_code")
    if status is None or status == ABORTED_BY_CLIENT:
        return
    message = str(finish.get("message", "Request aborted."))
    code = CONTEXT_CODE if "exceeds the maximum allowed length" in message else (
        "invalid_request_error" if 400 <= status < 500 else "service_unavailable")
    raise RequestError(message, status, code=code)
