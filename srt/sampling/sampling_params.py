"""`SamplingParams`: one request's decoding knobs, with SGLang's field names, defaults and checks.

Checks live here so that every entrypoint (HTTP, OpenAI layer, Engine) rejects the same values with
the same message: the parameter name first, then the allowed range, then the value received.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from srt.sampling.stop_regex import StopRegexError, compile_stop_regex
from srt.utils.bounded_repr import bounded_repr

# Below this temperature a request is decoded greedily (argmax), as in SGLang.
GREEDY_TEMPERATURE = 1e-6

_U64_MASK = (1 << 64) - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fail(message: str) -> None:
    raise ValueError(message)


# ------------------------------------------------------------------ SGLang field rules
# How this server takes each field of an SGLang request type. The rule types live here, in the
# lowest layer every entrypoint reaches, so /generate, the Engine and the OpenAI layer word a
# refusal alike. `null` always means a field's default.
IMPLEMENTED = "implemented"  # honoured as SGLang honours it


def _json_text(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def same_json_value(a: Any, b: Any) -> bool:
    """JSON equality: 0 == 0.0, but true is not 1 and "1" is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _is_number(a) and _is_number(b):
        return a == b
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class DefaultOnly:
    """A field this server takes only at its default: null, `default` or one of `same` (values that
    mean the same here) pass; anything else is refused naming the field and the value. `feature`
    names a planned feature (structured output, tool calling) whose fields keep their own message."""

    default: Any = None
    same: Tuple[Any, ...] = ()
    feature: Optional[str] = None

    def accepts(self, value: Any) -> bool:
        return value is None or any(same_json_value(value, v) for v in (self.default, *self.same))

    def refusal(self, name: str, value: Any) -> str:
        return (f"'{name}' is not supported by this server (got {_json_text(value)}); leave it at its default "
                f"{_json_text(self.default)}.")


@dataclass
class SamplingParams:
    """Decoding parameters of one request.

    An explicit `None` for a field with a non-None default means "use the default", so clients
    may send nulls. Call `verify()` (raises `ValueError` for bad values), then `normalize()`
    (canonical shapes: `stop` and `stop_regex` become lists, `logit_bias` keys become ints).
    `top_k == -1` stays -1 here; `SamplingBatchInfo` turns it into "the whole vocabulary".
    """

    max_new_tokens: int = 128  # 0 = prefill only
    min_new_tokens: int = 0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    logit_bias: Optional[Dict[Union[str, int], float]] = None
    sampling_seed: Optional[int] = None
    # SGLang fields accepted at their default only (SAMPLING_FIELDS says which and why).
    structural_tag: Optional[str] = None
    beam_width: Optional[int] = None
    stream_interval: Optional[int] = None
    custom_params: Optional[Dict[str, Any]] = None
    watermark: Optional[Dict[str, Any]] = None
    # Derived by normalize(): the longest stop string, in tokens when a tokenizer was given,
    # else in characters (an upper bound). The detokenizer holds back this much text.
    stop_str_max_len: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.init and getattr(self, f.name) is None and f.default is not None:
                setattr(self, f.name, f.default)

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "SamplingParams":
        """Build from a request's `sampling_params` object, refusing unknown keys by name."""
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            _fail(f"sampling_params must be an object, got {type(d).__name__}.")
        known = cls.field_names()
        for key in d:
            if key not in known:
                _fail(f"Unknown sampling parameter '{key}'. Supported: {', '.join(sorted(known))}.")
        return cls(**dict(d))

    @classmethod
    def field_names(cls) -> set:
        return {f.name for f in dataclasses.fields(cls) if f.init}

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax: temperature ~ 0 or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self.field_names()}

    # ------------------------------------------------------------------ checks
    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise `ValueError` naming the first bad parameter, its allowed range and its value.

        With `vocab_size`, token ids (`logit_bias` keys, `stop_token_ids`) are checked against it.
        """
        self._verify_types()
        self._verify_ranges()
        self._verify_lengths()
        self._verify_stops(vocab_size)
        self._verify_logit_bias(vocab_size)
        self._verify_grammar()
        self._verify_default_only()

    def _verify_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not _is_number(value):
                _fail(f"{name} must be a number, got {bounded_repr(value)}.")
        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            value = getattr(self, name)
            if not _is_int(value):
                _fail(f"{name} must be an integer, got {bounded_repr(value)}.")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                _fail(f"{name} must be a boolean, got {bounded_repr(value)}.")
        if self.sampling_seed is not None and not _is_int(self.sampling_seed):
            _fail(f"sampling_seed must be an integer or null, got {bounded_repr(self.sampling_seed)}.")

    def _verify_ranges(self) -> None:
        t = self.temperature
        if not (t >= 0 and math.isfinite(t)):
            _fail(f"temperature must be >= 0 and finite, got {t}.")
        if not 0 < self.top_p <= 1:
            _fail(f"top_p must be in (0, 1], got {self.top_p}.")
        if not (self.top_k == -1 or self.top_k >= 1):
            _fail(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            _fail(f"min_p must be in [0, 1], got {self.min_p}.")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                _fail(f"{name} must be in [-2, 2], got {value}.")
        if not 0 < self.repetition_penalty <= 2:
            _fail(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        if self.n < 1:
            _fail(f"n must be >= 1, got {self.n}.")

    def _verify_lengths(self) -> None:
        if self.max_new_tokens < 0:
            _fail(f"max_new_tokens must be >= 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            _fail(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                  f"got {self.min_new_tokens}.")

    def _verify_stops(self, vocab_size: Optional[int]) -> None:
        for s in _as_list(self.stop, "stop"):
            if not isinstance(s, str) or not s:
                _fail(f"stop must be a non-empty string or a list of them, got {bounded_repr(s)}.")
        for pattern in _as_list(self.stop_regex, "stop_regex"):
            if not isinstance(pattern, str) or not pattern:
                _fail(f"stop_regex must be a non-empty string or a list of them, got {bounded_repr(pattern)}.")
            try:
                compile_stop_regex(pattern)
            except StopRegexError as exc:
                _fail(f"stop_regex must be a regular expression RE2 can compile, got {bounded_repr(pattern)}: {exc}.")
        ids = self.stop_token_ids if self.stop_token_ids is not None else []
        if not isinstance(ids, (list, tuple, set)):
            _fail(f"stop_token_ids must be a list of token ids, got {bounded_repr(ids)}.")
        upper = vocab_size if vocab_size is not None else None
        for tid in ids:
            if not _is_int(tid) or tid < 0 or (upper is not None and tid >= upper):
                bound = f"[0, vocab_size={upper})" if upper is not None else ">= 0"
                _fail(f"stop_token_ids must hold token ids in {bound}, got {bounded_repr(tid)}.")

    def _verify_logit_bias(self, vocab_size: Optional[int]) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            _fail(f"logit_bias must be an object mapping token ids to biases, got {bounded_repr(self.logit_bias)}.")
        bound = f"[0, vocab_size={vocab_size})" if vocab_size is not None else "[0, vocab_size)"
        for key, bias in self.logit_bias.items():
            tid = _token_id_key(key)
            if tid is None or tid < 0 or (vocab_size is not None and tid >= vocab_size):
                _fail(f"logit_bias keys must be token ids in {bound}, got {bounded_repr(key)}.")
            if not _is_number(bias) or not math.isfinite(bias):
                _fail(f"logit_bias values must be finite numbers, got {bounded_repr(bias)} for token {bounded_repr(key)}.")

    def _verify_grammar(self) -> None:
        given = [name for name in ("regex", "json_schema", "ebnf", "structural_tag") if getattr(self, name) is not None]
        if len(given) > 1:
            _fail(f"regex, json_schema, ebnf and structural_tag are mutually exclusive (set at most one), "
                  f"got {' and '.join(given)}.")
        for name in given:
            if not isinstance(getattr(self, name), str):
                _fail(f"{name} must be a string, got {type(getattr(self, name)).__name__}.")

    def _verify_default_only(self) -> None:
        for name, rule in SAMPLING_FIELDS.items():
            value = getattr(self, name)
            if rule is IMPLEMENTED or rule.accepts(value):
                continue
            if rule.feature:
                _fail(f"sampling_params.{name} is not supported by this server yet ({rule.feature} is not "
                      f"implemented); remove it.")
            _fail(rule.refusal(name, value))

    # ------------------------------------------------------------- canonical form
    def normalize(self, tokenizer: Any = None) -> None:
        """Bring list-or-scalar fields to lists and derive `stop_str_max_len`.

        Idempotent. Assumes `verify()` passed (or raises its `ValueError` on malformed shapes).
        """
        self.stop = list(_as_list(self.stop, "stop"))
        self.stop_regex = list(_as_list(self.stop_regex, "stop_regex"))
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.logit_bias is not None:
            self.logit_bias = {_token_id_key(k): float(v) for k, v in self.logit_bias.items()}
        self.stop_str_max_len = max((self._stop_len(s, tokenizer) for s in self.stop), default=0)

    @staticmethod
    def _stop_len(stop: str, tokenizer: Any) -> int:
        if tokenizer is None:
            return len(stop)
        return len(tokenizer.encode(stop, add_special_tokens=False))



# Every API field of SGLang's SamplingParams and how this server takes it. SGLang's internal fields
# (stop_strs, stop_regex_strs, stop_str_max_len, stop_regex_max_len, is_normalized,
# ebnf_full_assistant) are filled by its own normalize(), are not API, and stay unknown here.
SAMPLING_FIELDS: Dict[str, Any] = {
    "max_new_tokens": IMPLEMENTED, "min_new_tokens": IMPLEMENTED, "n": IMPLEMENTED,
    "stop": IMPLEMENTED, "stop_token_ids": IMPLEMENTED, "stop_regex": IMPLEMENTED,
    "temperature": IMPLEMENTED, "top_p": IMPLEMENTED, "top_k": IMPLEMENTED, "min_p": IMPLEMENTED,
    "frequency_penalty": IMPLEMENTED, "presence_penalty": IMPLEMENTED, "repetition_penalty": IMPLEMENTED,
    "ignore_eos": IMPLEMENTED, "skip_special_tokens": IMPLEMENTED, "spaces_between_special_tokens": IMPLEMENTED,
    "no_stop_trim": IMPLEMENTED, "logit_bias": IMPLEMENTED, "sampling_seed": IMPLEMENTED,
    "regex": IMPLEMENTED, "json_schema": IMPLEMENTED, "ebnf": IMPLEMENTED, "structural_tag": IMPLEMENTED,
    "beam_width": DefaultOnly(None, (1,)),  # one beam is plain decoding; beam search is not implemented
    "stream_interval": DefaultOnly(),        # per request; the server's --stream-interval applies to all
    "custom_params": DefaultOnly(),          # input of a custom logit processor, which is not implemented
    "watermark": DefaultOnly(),
}
assert set(SAMPLING_FIELDS) == SamplingParams.field_names(), "SAMPLING_FIELDS must list every SamplingParams field"


def _as_list(value: Any, name: str) -> List[Any]:
    """`None` -> [], a string -> [string], a list/tuple -> itself; anything else is refused."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"{name} must be a string or a list of strings, got {bounded_repr(value)}.")


def _token_id_key(key: Any) -> Optional[int]:
    """`logit_bias` keys arrive as JSON strings ("50256") or ints; None when not an integer."""
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key.strip())
        except ValueError:
            return None
    return None


def fold_seed(seed: int) -> int:
    """Map any Python int seed onto a signed int64 (two's complement of its low 64 bits)."""
    folded = seed & _U64_MASK
    return folded - (1 << 64) if folded >= (1 << 63) else folded
