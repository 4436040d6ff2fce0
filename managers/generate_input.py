"""The API-level generate request (`/generate`, Engine) and its normalization into single items.

`GenerateReqInput` mirrors SGLang's JSON fields; `normalize()` checks shapes and types and returns
one `GenerateReqItem` per prompt, so the tokenizer manager never sees a batch-or-single union.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, Mapping, Optional, Union

# SGLang request fields this runtime does not implement: accepted only when null / false / empty.
UNSUPPORTED_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "modalities",
                      "session_params", "custom_logit_processor", "return_hidden_states")


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

    @classmethod
    def from_dict(cls, body: Any) -> "GenerateReqInput":
        """Build from a JSON body, refusing unknown fields (and set unsupported ones) by name."""
        if not isinstance(body, Mapping):
            _fail(f"The request body must be a JSON object, got {type(body).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {}
        for key, value in body.items():
            if key in known:
                fields[key] = value
            elif key in UNSUPPORTED_FIELDS:
                if value not in (None, False, [], {}, ""):
                    _fail(f"Field '{key}' is not supported by this server.", param=key)
            else:
                _fail(f"Unknown field '{key}'. Supported fields: {', '.join(sorted(known))}.", param=key)
        return cls(**fields)

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
            _fail(f"stream must be a boolean, got {self.stream!r}.", "stream")
        if not isinstance(self.return_text_in_logprobs, bool):
            _fail(f"return_text_in_logprobs must be a boolean, got {self.return_text_in_logprobs!r}.",
                  "return_text_in_logprobs")
        rids = self._rids(n, single)
        params = _per_item(self.sampling_params, "sampling_params", n, single, _check_params)
        return_logprob = _per_item(self.return_logprob, "return_logprob", n, single, _check_bool)
        start = _per_item(self.logprob_start_len, "logprob_start_len", n, single, _check_start)
        top = _per_item(self.top_logprobs_num, "top_logprobs_num", n, single, _check_top)
        token_ids = self._token_ids_logprob(n, single)
        keys = _per_item(self.extra_key, "extra_key", n, single, _check_key)
        salts = _per_item(self.cache_salt, "cache_salt", n, single, _check_key)
        items = []
        for i, (text, ids) in enumerate(prompts):
            items.append(GenerateReqItem(
                index=i, rid=rids[i], text=text, input_ids=ids, sampling_params=dict(params[i] or {}),
                stream=self.stream, return_logprob=bool(return_logprob[i]),
                logprob_start_len=-1 if start[i] is None else start[i],
                top_logprobs_num=top[i] or 0, token_ids_logprob=token_ids[i] or None,
                return_text_in_logprobs=self.return_text_in_logprobs,
                extra_key=_namespace(keys[i], salts[i])))
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
                _fail(f"rid must be a non-empty string for a single prompt, got {rid!r}.", "rid")
            return [rid]
        if not isinstance(rid, list) or len(rid) != n:
            _fail(f"rid must be a list of {n} strings for a batch of {n} prompts, got {rid!r}.", "rid")
        rids = [r if r is not None else uuid.uuid4().hex for r in rid]
        for r in rids:
            if not isinstance(r, str) or not r:
                _fail(f"rid entries must be non-empty strings, got {r!r}.", "rid")
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
        _fail(f"{name} must be a boolean, got {value!r}.", name.split("[")[0])
    return value


def _check_start(value: Any, name: str) -> Optional[int]:
    if value is not None and (not _is_int(value) or value < -1):
        _fail(f"{name} must be -1 (output tokens only) or a prompt position >= 0, got {value!r}.",
              name.split("[")[0])
    return value


def _check_top(value: Any, name: str) -> Optional[int]:
    if value is not None and (not _is_int(value) or value < 0):
        _fail(f"{name} must be an integer >= 0, got {value!r}.", name.split("[")[0])
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
