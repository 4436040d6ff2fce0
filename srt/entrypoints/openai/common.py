"""Pieces shared by the completions and chat endpoints: starting a generation (validation on the
first iteration), turning cumulative updates into deltas, usage, finish reasons, logprob shapes."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

import orjson
from aiohttp import web

from managers.generate_input import GenerateReqInput, RequestError
from srt.entrypoints import http_server
from srt.entrypoints.http_errors import json_error
from srt.entrypoints.openai.protocol import read_json_body

logger = logging.getLogger(__name__)


def error_response(exc: RequestError) -> web.Response:
    """The OpenAI error body. Sampling fields are top-level in an OpenAI body, so a refusal of
    `sampling_params.stop` names `stop`, as the client wrote it."""
    param = exc.param[len("sampling_params."):] if exc.param and exc.param.startswith("sampling_params.") else exc.param
    return json_error(exc.status_code, exc.message, code=exc.code, param=param)


def json_response(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_serving(state: Any) -> None:
    """503 while the runtime cannot take requests (a child died, or shutting down)."""
    http_server.check_serving(state)


async def start_generation(tokenizer_manager: Any, obj: GenerateReqInput) -> Tuple[AsyncIterator[Any], Any]:
    """Start `obj` and wait for its first update: bad input raises `RequestError` here, before any
    byte of the response is written."""
    updates = tokenizer_manager.generate_request(obj)
    try:
        first = await updates.__anext__()
    except BaseException:
        await updates.aclose()
        raise
    return updates, first


async def serve_plan(request: web.Request, build_plan: Callable[[Any, Any], Awaitable[Any]]) -> web.StreamResponse:
    """One OpenAI endpoint's request: read and check the body, `await build_plan(body, state)`, start
    the generation, then answer as SSE or one JSON object; `RequestError` becomes its JSON error."""
    from srt.entrypoints.openai.sse import stream_sse

    state = request.app["state"]
    try:
        check_serving(state)
        body = await read_json_body(request)
        plan = await build_plan(body, state)
        updates, first = await start_generation(state.tokenizer_manager, plan.obj)
    except RequestError as exc:
        return error_response(exc)
    if plan.stream:
        return await stream_sse(request, updates, first, plan.stream_chunks, plan.closing_chunks)
    await updates.aclose()
    return json_response(plan.response(first))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_fields(meta: Dict[str, Any]) -> Dict[str, Any]:
    """OpenAI `finish_reason` (stop / length / abort, null while running) plus `matched_stop`."""
    finish = meta.get("finish_reason")
    if not finish:
        return {"finish_reason": None, "matched_stop": None}
    kind = finish.get("type")
    return {"finish_reason": kind if kind in ("stop", "length", "abort") else "stop",
            "matched_stop": finish.get("matched") if kind == "stop" else None}


@dataclass
class ChoiceProgress:
    """What a stream already sent for one choice: text length and number of output logprobs."""

    text_len: int = 0
    logprobs_sent: int = 0
    input_logprobs_sent: int = 0
    text_offset: int = 0  # completions' legacy logprobs: characters covered by tokens sent so far
    final_meta: Optional[Dict[str, Any]] = None


@dataclass
class GenerationView:
    """Response-building state of one OpenAI request whose outputs are `n` choices per prompt."""

    response_id: str
    model: str
    n: int
    created: int = field(default_factory=lambda: int(time.time()))
    progress: Dict[int, ChoiceProgress] = field(default_factory=dict)

    def indexed(self, update: Any) -> List[Tuple[int, Dict[str, Any]]]:
        """(choice index, output) pairs of a stream update or a final result (dict or list)."""
        if isinstance(update, list):
            return list(enumerate(update))
        return [(int(update.get("index", 0)), update)]

    def delta(self, index: int, out: Dict[str, Any]) -> Tuple[str, int, int]:
        """New text since the last chunk of this choice, and the range of new output logprobs."""
        p = self.progress.setdefault(index, ChoiceProgress())
        text = out.get("text", "")
        if len(text) < p.text_len:  # cumulative text never shrinks; a delta cannot be taken back
            logger.warning("Choice %d of %s: cumulative text shrank.", index, self.response_id)
        new_text = text[p.text_len:]
        p.text_len = max(p.text_len, len(text))
        count = len(out["meta_info"].get("output_token_logprobs") or [])
        start, p.logprobs_sent = p.logprobs_sent, max(p.logprobs_sent, count)
        if out["meta_info"].get("finish_reason") is not None:
            p.final_meta = out["meta_info"]
        return new_text, start, count

    def usage_from(self, metas: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
        """Prompt and cached tokens counted once per prompt (its first choice), completion tokens
        over every choice: the same numbers streaming and not."""
        prompt = cached = completion = 0
        for index, meta in metas.items():
            completion += int(meta.get("completion_tokens", 0))
            if index % self.n == 0:
                prompt += int(meta.get("prompt_tokens", 0))
                cached += int(meta.get("cached_tokens", 0))
        return usage(prompt, completion, cached)

    def stream_usage(self) -> Dict[str, Any]:
        return self.usage_from({i: p.final_meta for i, p in self.progress.items() if p.final_meta is not None})


# ------------------------------------------------------------------ logprob shapes
def _top_entries(tops: Optional[list], i: int) -> list:
    if not tops or i >= len(tops) or tops[i] is None:
        return []
    return tops[i]


def _text(entry: list) -> str:
    return entry[2] if len(entry) > 2 and entry[2] is not None else ""


def chat_logprobs(meta: Dict[str, Any], start: int, end: int, top_k: int) -> Dict[str, Any]:
    """`{"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}` for output
    positions `start..end-1` (entries are `[logprob, token_id, text]`)."""
    tokens = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs")
    content = []
    for i in range(start, min(end, len(tokens))):
        entry = tokens[i]
        token = _text(entry)
        content.append({"token": token, "logprob": entry[0], "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [{"token": _text(t), "logprob": t[0], "bytes": list(_text(t).encode("utf-8"))}
                                         for t in _top_entries(tops, i)[:top_k]]})
    return {"content": content, "refusal": None}


@dataclass
class LegacyLogprobs:
    """Completions' `{tokens, token_logprobs, top_logprobs, text_offset}`; `top_logprobs` is null
    when the client asked for `logprobs: 0`."""

    top_k: int
    tokens: List[str] = field(default_factory=list)
    token_logprobs: List[Optional[float]] = field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = field(default_factory=list)
    text_offset: List[int] = field(default_factory=list)

    def add(self, entries: list, tops: Optional[list], start: int, end: int, offset: int,
            prompt: bool = False) -> int:
        """Append positions `start..end-1`; returns the text offset after them."""
        for i in range(start, min(end, len(entries))):
            entry = entries[i]
            token = _text(entry)
            self.tokens.append(token)
            self.token_logprobs.append(entry[0])
            if prompt and i == 0:
                self.top_logprobs.append(None)  # the first prompt token has no context
            else:
                top: Dict[str, float] = {}
                for t in _top_entries(tops, i)[: self.top_k]:
                    top.setdefault(_text(t), t[0])  # tokens decoding alike keep the likelier one
                self.top_logprobs.append(top)
            self.text_offset.append(offset)
            offset += len(token)
        return offset

    def to_json(self) -> Dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs if self.top_k > 0 else None, "text_offset": self.text_offset}
