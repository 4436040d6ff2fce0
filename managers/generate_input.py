"""The API-level generate request (`/generate`, Engine) and its normalization into single items.

`GenerateReqInput` mirrors SGLang's JSON fields; `normalize()` checks shapes and types and returns
one `GenerateReqItem` per prompt, so the tokenizer manager never sees a batch-or-single union.
`RequestLimits` is the one statement of how long a request may be, derived from the scheduler's
start-up numbers, that the front door, its max_new_tokens clamp and `/v1/models` all read.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Mapping, Optional, Tuple, Union

from srt.sampling.sampling_params import IMPLEMENTED, DefaultOnly
from srt.utils.bounded_repr import bounded_repr


class RequestError(ValueError):
    """A client mistake: the HTTP layer answers `status_code` with `message` (and `code` for OpenAI)."""

    def __init__(self, message: str, status_code: int = 400, code: Optional[str] = None,
                 param: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.code = code
        self.param = param


def _fail(message: str, param: Optional[str] = None) -> None:
    raise RequestError(message, 400, code="invalid_request_error", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


@dataclass(frozen=True)
class RequestLimits:
    """The effective length limits of one server, from the scheduler's `SchedulerReady` numbers
    (SGLang's arithmetic; C = context length, T = KV pool tokens, L = prompt tokens):

        max_req_len       = min(C - 1, T - 1)
        max_req_input_len = max_req_len - 5   admission refuses L >= max_req_input_len
        max_new_tokens   <= max_req_len - 1 - L   (prompt + completion <= max_req_len - 1)
        max_model_len     = max_req_input_len

    so every prompt shorter than `max_model_len` with L + max_new_tokens <= max_model_len runs
    exactly as asked; a larger max_new_tokens is clamped and the clamp is reported.
    """

    context_len: int
    max_req_len: int
    max_req_input_len: int
    max_total_num_tokens: int = 0  # T, only to name the binding limit

    @classmethod
    def from_scheduler_info(cls, info: Any) -> "RequestLimits":
        return cls(info.context_len, info.max_req_len, info.max_req_input_len, info.max_total_num_tokens)

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + completion) served as asked, whatever the split."""
        return max(self.max_req_input_len, 1)

    @property
    def max_total_tokens(self) -> int:
        """Most tokens (prompt + completion) one admitted request may reach."""
        return self.max_req_len - 1

    def max_new_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a prompt of `prompt_len` tokens may generate (admission's clamp)."""
        return max(0, self.max_total_tokens - prompt_len)

    def bound(self) -> str:
        """What sets `max_req_len`: the KV cache pool or the model's context length."""
        if self.max_req_len < self.context_len - 1:
            return (f"the KV cache pool ({self.max_total_num_tokens} tokens; raise --mem-fraction-static or "
                    f"--max-total-tokens for more)")
        return f"the model's context length ({self.context_len} tokens)"


@dataclass(frozen=True)
class Inert:
    """A field accepted whenever it has one of `types`, and that changes nothing on this server:
    `why` says why that matches SGLang (a caller-side id, a switch for a parser this server lacks)."""

    types: Tuple[type, ...]
    why: str


def check_field_rule(name: str, value: Any, rule: Any) -> None:
    """Refuse `value` of the non-implemented field `name` unless its rule (`DefaultOnly`, `Inert`) takes it."""
    if isinstance(rule, Inert):
        if value is not None and not isinstance(value, rule.types):
            kinds = " or ".join({str: "a string", bool: "a boolean", dict: "an object"}.get(t, t.__name__)
                                for t in rule.types)
            _fail(f"{name} must be {kinds}, got {bounded_repr(value)}.", name.split(".")[0])
    elif not rule.accepts(value):
        _fail(rule.refusal(name, value), name.split(".")[0])


@dataclass
class GenerateReqItem:
    """One prompt of a (possibly batched) request, after normalization."""

    index: int
    rid: str
    text: Optional[str]
    input_ids: Optional[List[int]]
    sampling_params: Dict[str, Any]  # the client's raw dict: explicit keys matter for validation
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: Optional[List[int]] = None
    return_text_in_logprobs: bool = False
    extra_key: Optional[Hashable] = None
    data_parallel_rank: Optional[int] = None


@dataclass
class GenerateReqInput:
    """SGLang's `/generate` body. `text` or `input_ids` (exactly one) decides single vs batch:
    a str / list[int] is one prompt, a list[str] / list[list[int]] is a batch; every per-item field
    is then a scalar (shared) or a list of the batch's length."""

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[Dict[str, Any], List[Optional[Dict[str, Any]]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    stream: bool = False
    return_logprob: Optional[Union[bool, List[bool]]] = None
    logprob_start_len: Optional[Union[int, List[int]]] = None
    top_logprobs_num: Optional[Union[int, List[int]]] = None
    token_ids_logprob: Optional[Union[List[int], List[List[int]]]] = None
    return_text_in_logprobs: bool = False
    extra_key: Optional[Union[str, List[str]]] = None
    cache_salt: Optional[Union[str, List[str]]] = None
    data_parallel_rank: Optional[int] = None  # the replica to run on (sglang-router --dp-aware); range checked later

    @classmethod
    def from_dict(cls, body: Any) -> "GenerateReqInput":
        """Build from a JSON body: `GENERATE_FIELDS` decides each field (null means its default);
        a field SGLang does not define is refused by name."""
        if not isinstance(body, Mapping):
            _fail(f"The request body must be a JSON object, got {type(body).__name__}.")
        fields = {}
        for key, value in body.items():
            rule = GENERATE_FIELDS.get(key)
            if rule is None:
                supported = sorted(k for k, r in GENERATE_FIELDS.items() if not isinstance(r, DefaultOnly))
                _fail(f"Unknown field '{key}'. Supported fields: {', '.join(supported)}.", param=key)
            if value is None:
                continue
            if rule is IMPLEMENTED:
                fields[key] = value
            else:
                check_field_rule(key, value, rule)
        return cls(**fields)

    @property
    def num_prompts(self) -> int:
        """How many prompts the body carries, counted before any of them is checked (O(1))."""
        prompts = self.text if self.text is not None else self.input_ids
        if isinstance(prompts, list) and prompts and (self.text is not None or isinstance(prompts[0], list)):
            return len(prompts)
        return 1

    @property
    def is_single(self) -> bool:
        """True for one prompt (the response is one dict), False for a batch (a list)."""
        if isinstance(self.text, str):
            return True
        if self.text is None and isinstance(self.input_ids, list):
            return not self.input_ids or not isinstance(self.input_ids[0], list)
        return False

    def normalize(self) -> List[GenerateReqItem]:
        """Check shapes and types; return one item per prompt (rids generated where missing)."""
        prompts = self._prompts()
        n = len(prompts)
        single = self.is_single
        if not isinstance(self.stream, bool):
            _fail(f"stream must be a boolean, got {bounded_repr(self.stream)}.", "stream")
        if not isinstance(self.return_text_in_logprobs, bool):
            _fail(f"return_text_in_logprobs must be a boolean, got {bounded_repr(self.return_text_in_logprobs)}.",
                  "return_text_in_logprobs")
        rids = self._rids(n, single)
        params = _per_item(self.sampling_params, "sampling_params", n, single, _check_params)
        return_logprob = _per_item(self.return_logprob, "return_logprob", n, single, _check_bool)
        start = _per_item(self.logprob_start_len, "logprob_start_len", n, single, _check_start)
        top = _per_item(self.top_logprobs_num, "top_logprobs_num", n, single, _check_top)
        token_ids = self._token_ids_logprob(n, single)
        keys = _per_item(self.extra_key, "extra_key", n, single, _check_key)
        salts = _per_item(self.cache_salt, "cache_salt", n, single, _check_key)
        if self.data_parallel_rank is not None and (not _is_int(self.data_parallel_rank) or self.data_parallel_rank < 0):
            _fail(f"data_parallel_rank must be an integer >= 0, got {bounded_repr(self.data_parallel_rank)}.", "data_parallel_rank")
        items = []
        for i, (text, ids) in enumerate(prompts):
            items.append(GenerateReqItem(
                index=i, rid=rids[i], text=text, input_ids=ids, sampling_params=dict(params[i] or {}),
                stream=self.stream, return_logprob=bool(return_logprob[i]),
                logprob_start_len=-1 if start[i] is None else start[i],
                top_logprobs_num=top[i] or 0, token_ids_logprob=token_ids[i] or None,
                return_text_in_logprobs=self.return_text_in_logprobs,
                extra_key=_namespace(keys[i], salts[i]), data_parallel_rank=self.data_parallel_rank))
        return items

    # ------------------------------------------------------------------ pieces
    def _prompts(self) -> List[tuple]:
        has_text, has_ids = self.text is not None, self.input_ids is not None
        if has_text == has_ids:
            _fail("Specify exactly one of 'text' or 'input_ids'" + (", not both." if has_text else "."))
        if has_text:
            texts = [self.text] if isinstance(self.text, str) else self.text
            if not isinstance(texts, list):
                _fail(f"text must be a string or a list of strings, got {type(self.text).__name__}.", "text")
            if not texts:
                _fail("text is an empty list: send at least one prompt.", "text")
            for i, t in enumerate(texts):
                where = "text" if isinstance(self.text, str) else f"text[{i}]"
                if not isinstance(t, str):
                    _fail(f"{where} must be a string, got {type(t).__name__}.", "text")
                if not t:
                    _fail(f"{where} is empty: send a non-empty prompt.", "text")
            return [(t, None) for t in texts]
        ids = self.input_ids
        if not isinstance(ids, list):
            _fail(f"input_ids must be a list of token ids or a list of such lists, got {type(ids).__name__}.",
                  "input_ids")
        if not ids:
            _fail("input_ids is empty: send at least one token.", "input_ids")
        if not isinstance(ids[0], list):
            if not _is_id_list(ids):
                _fail("input_ids must be a list of integer token ids (or a list of such lists).", "input_ids")
            return [(None, list(ids))]
        for i, row in enumerate(ids):
            if not _is_id_list(row):
                _fail(f"input_ids[{i}] must be a list of integer token ids.", "input_ids")
            if not row:
                _fail(f"input_ids[{i}] is empty: send at least one token.", "input_ids")
        return [(None, list(row)) for row in ids]

    def _rids(self, n: int, single: bool) -> List[str]:
        rid = self.rid
        if rid is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if single:
            if not isinstance(rid, str) or not rid:
                _fail(f"rid must be a non-empty string for a single prompt, got {bounded_repr(rid)}.", "rid")
            return [rid]
        if not isinstance(rid, list) or len(rid) != n:
            _fail(f"rid must be a list of {n} strings for a batch of {n} prompts, got {bounded_repr(rid)}.", "rid")
        rids = [r if r is not None else uuid.uuid4().hex for r in rid]
        for r in rids:
            if not isinstance(r, str) or not r:
                _fail(f"rid entries must be non-empty strings, got {bounded_repr(r)}.", "rid")
        if len(set(rids)) != n:
            _fail("rid entries of a batch must be distinct.", "rid")
        return rids

    def _token_ids_logprob(self, n: int, single: bool) -> List[Optional[List[int]]]:
        value = self.token_ids_logprob
        if value is None or value == []:
            return [None] * n
        if _is_id_list(value):
            return [list(value)] * n  # one list shared by every prompt
        if single or not isinstance(value, list) or len(value) != n:
            _fail(f"token_ids_logprob must be a list of token ids"
                  + ("" if single else f", or a list of {n} such lists (one per prompt)") + ".", "token_ids_logprob")
        for row in value:
            if row is not None and not _is_id_list(row):
                _fail("token_ids_logprob entries must be lists of integer token ids.", "token_ids_logprob")
        return [list(row) if row else None for row in value]


def _per_item(value: Any, name: str, n: int, single: bool, check) -> List[Any]:
    """A scalar is shared by every item; a list must have one entry per prompt (batches only)."""
    if not isinstance(value, list):
        return [check(value, name)] * n
    if single:
        kind = "an object" if name == "sampling_params" else "a single value"
        _fail(f"{name} must be {kind} for a single prompt, got a list.", name)
    if len(value) != n:
        _fail(f"{name} has {len(value)} entries but the batch has {n} prompts.", name)
    return [check(v, f"{name}[{i}]") for i, v in enumerate(value)]


def _check_params(value: Any, name: str) -> Optional[Dict[str, Any]]:
    if value is not None and not isinstance(value, Mapping):
        _fail(f"{name} must be an object, got {type(value).__name__}.", "sampling_params")
    return value


def _check_bool(value: Any, name: str) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        _fail(f"{name} must be a boolean, got {bounded_repr(value)}.", name.split("[")[0])
    return value


def _check_start(value: Any, name: str) -> Optional[int]:
    if value is not None and (not _is_int(value) or value < -1):
        _fail(f"{name} must be -1 (output tokens only) or a prompt position >= 0, got {bounded_repr(value)}.",
              name.split("[")[0])
    return value


def _check_top(value: Any, name: str) -> Optional[int]:
    if value is not None and (not _is_int(value) or value < 0):
        _fail(f"{name} must be an integer >= 0, got {bounded_repr(value)}.", name.split("[")[0])
    return value


def _check_key(value: Any, name: str) -> Optional[str]:
    if value is not None and not isinstance(value, str):
        _fail(f"{name} must be a string, got {type(value).__name__}.", name.split("[")[0])
    return value or None


def _namespace(extra_key: Optional[str], cache_salt: Optional[str]) -> Optional[Hashable]:
    """The radix-cache namespace: requests share cached prefixes only within the same one."""
    if extra_key and cache_salt:
        return (extra_key, cache_salt)
    return extra_key or cache_salt


# ------------------------------------------------------------------ SGLang's GenerateReqInput
_NULL, _FALSE = DefaultOnly(), DefaultOnly(False)
_NO_MEDIA = DefaultOnly(None, ([],))  # this runtime serves text-only models
_CALLER_ID = Inert((str,), "a caller-side id; SGLang passes it through without changing the output")

# Every field of SGLang's GenerateReqInput (0.5.23) and how this server takes it: IMPLEMENTED
# (a field of the dataclass above), Inert, or DefaultOnly.
GENERATE_FIELDS: Dict[str, Any] = {
    # prompt, sampling, output form
    "text": IMPLEMENTED, "input_ids": IMPLEMENTED, "sampling_params": IMPLEMENTED, "rid": IMPLEMENTED,
    "stream": IMPLEMENTED, "extra_key": IMPLEMENTED, "cache_salt": IMPLEMENTED,
    # logprobs
    "return_logprob": IMPLEMENTED, "logprob_start_len": IMPLEMENTED, "top_logprobs_num": IMPLEMENTED,
    "token_ids_logprob": IMPLEMENTED, "return_text_in_logprobs": IMPLEMENTED,
    "return_sampling_mask": DefaultOnly(None, (False,)), "sampling_logprobs_mode": _NULL,
    "return_flat_raw_top_logprobs": _FALSE, "return_flat_raw_output_top_logprobs": _FALSE,
    "return_flat_raw_top_logprobs_b64": _FALSE,
    # caller-side ids and labels; `model` is not SGLang's but sglang-router adds it to /generate
    "model": Inert((str,), "any model name is served (sglang-router names one on /generate)"),
    "session_id": _CALLER_ID, "conversation_id": _CALLER_ID,
    "custom_labels": Inert((dict,), "metric labels of the caller; this server's metrics have none"),
    # multimodal inputs
    "input_embeds": _NULL, "image_data": _NO_MEDIA, "video_data": _NO_MEDIA, "audio_data": _NO_MEDIA,
    "modalities": _NO_MEDIA, "mm_hashes": _NULL, "mm_content_hashes": _NULL, "use_audio_in_video": _FALSE,
    "video_config": _NULL, "images_config": _NULL, "mm_processor_kwargs": _NULL,
    "max_dynamic_patch": _NULL, "min_dynamic_patch": _NULL, "image_max_dynamic_patch": _NULL,
    "video_max_dynamic_patch": _NULL, "positional_embed_overrides": _NULL,
    "need_wait_for_mm_inputs": DefaultOnly(None, (False,)), "num_items_assigned": _NULL, "encoder_urls": _NULL,
    # outputs beyond text and logprobs
    "return_hidden_states": _FALSE, "return_routed_experts": _FALSE, "routed_experts_start_len": DefaultOnly(0),
    "return_indexer_topk": _FALSE, "return_bytes": _FALSE, "return_entropy": _FALSE,
    "return_prompt_token_ids": _FALSE, "multi_item_delimiter_indices": _NULL, "token_indices_to_pool": _NULL,
    # adapters, custom processors, sessions
    "lora_path": _NULL, "lora_id": _NULL, "custom_logit_processor": _NULL, "watermark": _NULL,
    "session_params": _NULL,
    # disaggregation and routing
    "bootstrap_host": _NULL, "bootstrap_port": _NULL, "bootstrap_room": _NULL, "bootstrap_pair_key": _NULL,
    "decode_tp_size": _NULL, "routed_dp_rank": _NULL, "data_parallel_rank": IMPLEMENTED,
    "disagg_prefill_dp_rank": _NULL, "routing_key": _NULL, "http_worker_ipc": _NULL, "kv_hints": _NULL,
    # scheduling, reasoning, logging
    "priority": _NULL, "background": _FALSE, "require_reasoning": _FALSE, "max_thinking_tokens": _NULL,
    "log_metrics": DefaultOnly(True), "no_logs": _FALSE, "external_trace_header": _NULL, "received_time": _NULL,
}
assert {k for k, r in GENERATE_FIELDS.items() if r is IMPLEMENTED} == {f.name for f in dataclasses.fields(
    GenerateReqInput)}, "GENERATE_FIELDS must mark exactly the dataclass fields IMPLEMENTED"
