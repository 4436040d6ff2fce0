"""`POST /v1/chat/completions`: messages -> chat template -> token ids -> generate, answered in
OpenAI's chat shapes (`n` choices, chat `logprobs` / `top_logprobs`, streaming deltas)."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from aiohttp import web

from managers.generate_input import GenerateReqInput
from srt.entrypoints.openai.common import (
    GenerationView,
    chat_logprobs,
    finish_fields,
    new_id,
    serve_plan,
)
from srt.entrypoints.openai.fields import CHAT_FIELDS
from srt.entrypoints.openai.tool_calls import ToolCallParser, ToolPlan, parse_tool_plan
from srt.entrypoints.openai.protocol import (
    check_fields,
    check_model,
    client_rid,
    get_bool,
    get_int,
    invalid,
    max_logprobs,
    sampling_params,
    stream_options,
)

ENDPOINT = "/v1/chat/completions"
RENDER_IN_THREAD_MESSAGES = 64
_RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tokenize", "chat_template", "tools")


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await serve_plan(request, ChatRequest.from_body)


def _max_tokens(body: Dict[str, Any]) -> Optional[int]:
    max_tokens = get_int(body, "max_tokens", 1)
    max_completion = get_int(body, "max_completion_tokens", 1)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise invalid(f"max_tokens ({max_tokens}) and max_completion_tokens ({max_completion}) disagree; "
                      "set only max_completion_tokens.", "max_tokens")
    return max_completion if max_completion is not None else max_tokens


def _template_kwargs(body: Dict[str, Any]) -> Dict[str, Any]:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise invalid(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}.", "chat_template_kwargs")
    for key in _RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise invalid(f"chat_template_kwargs may not set '{key}' (the server sets it).", "chat_template_kwargs")
    return kwargs


def _given_input_ids(body: Dict[str, Any]) -> Optional[List[int]]:
    """SGLang's chat `input_ids`: the prompt already tokenized, used instead of the chat template."""
    ids = body.get("input_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise invalid(f"input_ids must be a non-empty list of integer token ids, got {ids!r}.", "input_ids")
    return ids


async def _render(messages: Any, continue_final: bool, kwargs: Dict[str, Any], state: Any) -> List[int]:
    """Messages -> chat template -> token ids. With `continue_final_message`, a final assistant
    message is not closed: its text follows the generation prompt and the model continues it (SGLang)."""
    prefix = ""
    if continue_final and isinstance(messages, list) and messages:
        last = messages[-1]
        if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str):
            messages, prefix = messages[:-1], last["content"]
    tm = state.tokenizer_manager
    render = functools.partial(tm.chat_to_prompt, messages, add_generation_prompt=True, **kwargs)
    # Many messages render in a worker thread (Jinja is Python: it yields the GIL every few ms),
    # so the event loop keeps answering /health (4,096 messages take ~100 ms to render).
    many = isinstance(messages, list) and len(messages) > RENDER_IN_THREAD_MESSAGES
    prompt = await asyncio.get_running_loop().run_in_executor(None, render) if many else render()
    # No special tokens: the template already holds BOS where the model wants it.
    ids = await tm.encode_prompt(prompt, add_special_tokens=False)
    if prefix:
        ids = ids + await tm.encode_prompt(prefix, add_special_tokens=False)
    if not ids:
        raise invalid("The messages rendered to an empty prompt.", "messages")
    return ids


@dataclass
class ChatRequest:
    """A validated chat request and the state needed to answer it."""

    obj: GenerateReqInput
    view: GenerationView
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    tool_plan: Optional[ToolPlan] = None
    tool_parser_name: str = "hermes"
    roles_sent: bool = False
    parsers: Dict[int, ToolCallParser] = None  # streaming: one per choice

    @classmethod
    async def from_body(cls, body: Dict[str, Any], state: Any) -> "ChatRequest":
        check_fields(body, CHAT_FIELDS, ENDPOINT)
        check_model(body)
        stream = get_bool(body, "stream")
        include_usage = stream_options(body, stream)
        logprobs = get_bool(body, "logprobs")
        top = get_int(body, "top_logprobs", 0, max_logprobs(state), "--max-logprobs") or 0
        if top and not logprobs:
            raise invalid("top_logprobs requires logprobs: true.", "top_logprobs")
        limit = _max_tokens(body)
        if body.get("messages") is None:
            raise invalid("messages is required: a non-empty list of {role, content} objects.", "messages")
        state.tokenizer_manager.bounds.check_chat_messages(body["messages"])
        kwargs = _template_kwargs(body)
        continue_final = get_bool(body, "continue_final_message")
        params = sampling_params(body, limit)  # validate sampling fields before tokenizing
        plan = parse_tool_plan(body)
        if plan is not None and plan.choice != "none":
            kwargs = {**kwargs, "tools": plan.tools}
            schema = plan.grammar_schema()
            if schema is not None:
                if any(k in params for k in ("regex", "ebnf", "json_schema")):
                    raise invalid("tool_choice 'required' or a named function constrains the output itself; drop "
                                  "response_format / regex / ebnf / json_schema.", "tool_choice")
                params["json_schema"] = schema
        rid = client_rid(body, 1)
        tm = state.tokenizer_manager
        ids = _given_input_ids(body)
        if ids is None:
            ids = await _render(body["messages"], continue_final, kwargs, state)
        room = tm.limits.max_new_tokens_for(len(ids))
        if limit is None and room > 0:
            params["max_new_tokens"] = room  # OpenAI: the rest of what one request may hold
        response_id = rid or new_id("chatcmpl")  # SGLang answers with the request's own id
        obj = GenerateReqInput(
            input_ids=ids, sampling_params=params, rid=response_id, stream=stream, return_logprob=logprobs,
            top_logprobs_num=top, return_text_in_logprobs=True, extra_key=body.get("extra_key"),
            cache_salt=body.get("cache_salt"), data_parallel_rank=body.get("data_parallel_rank"))
        view = GenerationView(response_id, state.model_name, params.get("n", 1))
        parser = getattr(state.server_args, "tool_call_parser", None) or "hermes"
        return cls(obj, view, stream, include_usage, logprobs, top,
                   plan if plan is not None and plan.choice != "none" else None, parser)

    def _tool_parser(self) -> ToolCallParser:
        return ToolCallParser(self.tool_plan, "hermes" if self.tool_parser_name == "qwen25" else self.tool_parser_name)

    def _envelope(self, obj_type: str, choices: List[Dict[str, Any]]) -> Dict[str, Any]:
        v = self.view
        return {"id": v.response_id, "object": obj_type, "created": v.created, "model": v.model, "choices": choices}

    # ------------------------------------------------------------------ non-streaming
    def response(self, result: Any) -> Dict[str, Any]:
        outs = sorted(self.view.indexed(result), key=lambda pair: pair[0])
        choices = []
        for index, out in outs:
            meta = out["meta_info"]
            logprobs = chat_logprobs(meta, 0, 1 << 62, self.top_logprobs) if self.logprobs else None
            message: Dict[str, Any] = {"role": "assistant", "content": out["text"]}
            finish = finish_fields(meta)
            if self.tool_plan is not None:
                content, calls = self._tool_parser().parse(out["text"])
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
                    finish = {"finish_reason": "tool_calls", "matched_stop": None}
            choices.append({"index": index, "message": message, "logprobs": logprobs, **finish})
        body = self._envelope("chat.completion", choices)
        body["usage"] = self.view.usage_from({index: out["meta_info"] for index, out in outs})
        return body

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choice: Dict[str, Any]) -> Dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def stream_chunks(self, update: Any) -> List[Dict[str, Any]]:
        chunks = []
        if not self.roles_sent:
            self.roles_sent = True
            for index in range(self.view.n):
                chunks.append(self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None, "matched_stop": None}))
        for index, out in self.view.indexed(update):
            new_text, start, end = self.view.delta(index, out)
            meta = out["meta_info"]
            logprobs = chat_logprobs(meta, start, end, self.top_logprobs) if self.logprobs and end > start else None
            finish = finish_fields(meta)
            delta: Dict[str, Any] = {"content": new_text} if new_text else {}
            if self.tool_plan is not None:
                delta, finish = self._tool_delta(index, new_text, finish)
            if not (delta or logprobs or finish["finish_reason"]):
                continue
            chunks.append(self._chunk({"index": index, "delta": delta, "logprobs": logprobs, **finish}))
        return chunks

    def _tool_delta(self, index: int, new_text: str, finish: Dict[str, Any]):
        """Text that cannot belong to a call streams as content; each completed call is sent once."""
        if self.parsers is None:
            self.parsers = {}
        parser = self.parsers.setdefault(index, self._tool_parser())
        text, calls = parser.feed(new_text, final=finish["finish_reason"] is not None)
        delta: Dict[str, Any] = {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        if finish["finish_reason"] is not None and parser.emitted:
            finish = {"finish_reason": "tool_calls", "matched_stop": None}
        return delta, finish

    def closing_chunks(self) -> List[Dict[str, Any]]:
        if not self.include_usage:
            return []
        chunk = self._envelope("chat.completion.chunk", [])
        chunk["usage"] = self.view.stream_usage()
        return [chunk]
