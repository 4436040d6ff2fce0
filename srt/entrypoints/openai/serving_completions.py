"""`POST /v1/completions`: OpenAI text completions (single or batched prompts, `n`, `echo`,
legacy `logprobs`, streaming) on top of the tokenizer manager's generate path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from aiohttp import web

from managers.generate_input import GenerateReqInput
from srt.entrypoints.openai.common import (
    GenerationView,
    LegacyLogprobs,
    finish_fields,
    new_id,
    serve_plan,
)
from srt.entrypoints.openai.fields import COMPLETION_FIELDS
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

ENDPOINT = "/v1/completions"
DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for completions
_ALL = 1 << 62


async def handle_completions(request: web.Request) -> web.StreamResponse:
    async def build(body: Dict[str, Any], state: Any) -> "CompletionRequest":
        return CompletionRequest.from_body(body, state)

    return await serve_plan(request, build)


def _prompts(value: Any) -> Tuple[Optional[Any], Optional[Any], int]:
    """(text, input_ids, number of prompts) for GenerateReqInput from OpenAI's `prompt`."""
    if value is None:
        raise invalid("prompt is required: a string, a list of strings, a list of token ids, or a list of "
                      "token-id lists.", "prompt")
    if isinstance(value, str):
        if not value:
            raise invalid("prompt is empty: send a non-empty prompt.", "prompt")
        return value, None, 1
    if not isinstance(value, list) or not value:
        raise invalid("prompt must be a non-empty string or a non-empty list (of strings, of token ids, or of "
                      f"token-id lists), got {value!r}.", "prompt")
    if all(isinstance(p, str) for p in value):
        if not all(value):
            raise invalid("prompt contains an empty string: every prompt must be non-empty.", "prompt")
        return (value[0], None, 1) if len(value) == 1 else (value, None, len(value))
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None, value, 1
    if all(isinstance(row, list) and row and all(isinstance(t, int) and not isinstance(t, bool) for t in row)
           for row in value):
        return (None, value[0], 1) if len(value) == 1 else (None, value, len(value))
    raise invalid("prompt must be a string, a list of strings, a list of token ids, or a list of non-empty "
                  "token-id lists (not a mix).", "prompt")


@dataclass
class CompletionRequest:
    """A validated completions request and the state needed to answer it."""

    obj: GenerateReqInput
    view: GenerationView
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: Optional[int]
    prompt_values: List[Any]  # per prompt: its text, or its token ids (decoded only for echo)
    tokenizer: Any

    @classmethod
    def from_body(cls, body: Dict[str, Any], state: Any) -> "CompletionRequest":
        check_fields(body, COMPLETION_FIELDS, ENDPOINT)
        check_model(body)
        stream = get_bool(body, "stream")
        include_usage = stream_options(body, stream)
        echo = get_bool(body, "echo")
        k = get_int(body, "logprobs", 0, max_logprobs(state), "--max-logprobs")
        max_tokens = get_int(body, "max_tokens", 0)
        text, ids, num_prompts = _prompts(body.get("prompt"))
        params = sampling_params(body, DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
        rid: Any = client_rid(body, num_prompts)
        if rid is None:
            response_id = new_id("cmpl")
            rid = response_id if num_prompts == 1 else [f"{response_id}-p{i}" for i in range(num_prompts)]
        else:  # SGLang answers with the request's own id (a batch's: its first prompt's)
            response_id = rid if isinstance(rid, str) else rid[0]
        obj = GenerateReqInput(
            text=text, input_ids=ids, sampling_params=params, rid=rid, stream=stream,
            return_logprob=k is not None, logprob_start_len=0 if echo and k is not None else -1,
            top_logprobs_num=k or 0, return_text_in_logprobs=True, extra_key=body.get("extra_key"),
            cache_salt=body.get("cache_salt"), data_parallel_rank=body.get("data_parallel_rank"))
        single = text if text is not None else ids
        values = [single] if num_prompts == 1 else list(single)
        view = GenerationView(response_id, state.model_name, params.get("n", 1))
        return cls(obj, view, stream, include_usage, echo, k, values, state.tokenizer_manager.tokenizer)

    # ------------------------------------------------------------------ pieces
    def _prompt_text(self, index: int) -> str:
        value = self.prompt_values[index // self.view.n]
        return value if isinstance(value, str) else self.tokenizer.decode(value)

    def _envelope(self, choices: List[Dict[str, Any]]) -> Dict[str, Any]:
        v = self.view
        return {"id": v.response_id, "object": "text_completion", "created": v.created, "model": v.model,
                "choices": choices}

    # ------------------------------------------------------------------ non-streaming
    def response(self, result: Any) -> Dict[str, Any]:
        outs = sorted(self.view.indexed(result), key=lambda pair: pair[0])
        choices = []
        for index, out in outs:
            meta = out["meta_info"]
            logprobs = None
            if self.logprobs is not None:
                lp = LegacyLogprobs(self.logprobs)
                offset = lp.add(meta.get("input_token_logprobs") or [], meta.get("input_top_logprobs"), 0, _ALL, 0,
                                prompt=True) if self.echo else 0
                lp.add(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"), 0, _ALL, offset)
                logprobs = lp.to_json()
            text = self._prompt_text(index) + out["text"] if self.echo else out["text"]
            choices.append({"index": index, "text": text, "logprobs": logprobs, **finish_fields(meta)})
        body = self._envelope(choices)
        body["usage"] = self.view.usage_from({index: out["meta_info"] for index, out in outs})
        return body

    # ------------------------------------------------------------------ streaming
    def stream_chunks(self, update: Any) -> List[Dict[str, Any]]:
        chunks = []
        for index, out in self.view.indexed(update):
            first = index not in self.view.progress
            new_text, start, end = self.view.delta(index, out)
            progress = self.view.progress[index]
            meta = out["meta_info"]
            prefix = self._prompt_text(index) if first and self.echo else ""
            logprobs = None
            if self.logprobs is not None:
                lp = LegacyLogprobs(self.logprobs)
                if self.echo:
                    entries = meta.get("input_token_logprobs") or []
                    progress.text_offset = lp.add(entries, meta.get("input_top_logprobs"), progress.input_logprobs_sent,
                                                  _ALL, progress.text_offset, prompt=True)
                    progress.input_logprobs_sent = len(entries)
                progress.text_offset = lp.add(meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs"),
                                              start, end, progress.text_offset)
                logprobs = lp.to_json() if lp.tokens else None
            finish = finish_fields(meta)
            if not (prefix or new_text or logprobs or finish["finish_reason"]):
                continue
            chunk = self._envelope([{"index": index, "text": prefix + new_text, "logprobs": logprobs, **finish}])
            if self.include_usage:
                chunk["usage"] = None
            chunks.append(chunk)
        return chunks

    def closing_chunks(self) -> List[Dict[str, Any]]:
        if not self.include_usage:
            return []
        chunk = self._envelope([])
        chunk["usage"] = self.view.stream_usage()
        return [chunk]
