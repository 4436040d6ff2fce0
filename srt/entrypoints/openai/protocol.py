"""OpenAI request validation: per-endpoint field whitelists, types and ranges, and the mapping
of OpenAI sampling fields onto SGLang `sampling_params`.

Every field is honoured or refused by name: supported fields are listed per endpoint, fields of
the OpenAI API this server does not implement yet are refused unless they carry their no-op
default, and anything else is an unknown field.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional

from aiohttp import web

from managers.generate_input import RequestError
from srt.entrypoints import http_server

MAX_LOGPROBS = 20  # completions `logprobs` and chat `top_logprobs` upper bound
MAX_N = 128

# OpenAI sampling fields shared by both endpoints, plus SGLang / vLLM extensions that clients send
# through the SDK's `extra_body` (e.g. `top_k`).
COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "stop", "max_tokens", "temperature", "top_p",
    "frequency_penalty", "presence_penalty", "seed", "logit_bias", "user",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "stop_token_ids", "no_stop_trim", "cache_salt",
})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "chat_template_kwargs"}


def _is_none(v: Any) -> bool:
    return v is None


def _none_or(*allowed: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or v in allowed


def _text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


# OpenAI fields not implemented yet: name -> accepts the value as a no-op (its default).
COMPLETION_UNSUPPORTED: Dict[str, Callable[[Any], bool]] = {
    "suffix": _none_or(""),
    "best_of": _none_or(1),
}
CHAT_UNSUPPORTED: Dict[str, Callable[[Any], bool]] = {
    "tools": _none_or([]),
    "tool_choice": _none_or("none"),
    "parallel_tool_calls": _is_none,
    "functions": _none_or([]),
    "function_call": _none_or("none"),
    "response_format": _text_format,  # json_schema / regex land with structured output
    "audio": _is_none,
    "modalities": _none_or(["text"]),
    "prediction": _is_none,
    "reasoning_effort": _is_none,
    "store": _none_or(False),
    "metadata": _none_or({}),
    "service_tier": _none_or("auto", "default"),
    "web_search_options": _is_none,
    "verbosity": _is_none,
}


def invalid(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(message, 400, code="invalid_request_error", param=param)


async def read_json_body(request: web.Request) -> Dict[str, Any]:
    """The request body as a JSON object: the server's body reader (400 for empty, non-UTF-8 or
    malformed JSON, 413 over the size cap), then a 400 for anything but an object."""
    body = await http_server.read_json_body(request)
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def check_fields(body: Mapping[str, Any], allowed: frozenset, unsupported: Dict[str, Callable[[Any], bool]],
                 endpoint: str) -> None:
    """Refuse unknown fields and unsupported fields that carry a non-default value, by name."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in unsupported:
            if unsupported[key](value):
                continue
            raise invalid(f"'{key}' is not supported by this server yet ({endpoint}); remove it from the "
                          f"request.", key)
        raise invalid(f"Unknown field '{key}' for {endpoint}. Supported fields: {', '.join(sorted(allowed))}.",
                      key)


def check_model(body: Mapping[str, Any], served_name: str, model_path: Optional[str]) -> None:
    """`model` may be omitted, or name the served model (its served name or its path)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid(f"model must be a string, got {type(model).__name__}.", "model")
    if model_matches(model, served_name, model_path):
        return
    raise RequestError(f"The model '{model}' does not exist. This server serves '{served_name}' "
                       f"(see GET /v1/models).", 404, code="model_not_found", param="model")


def model_matches(model: str, served_name: str, model_path: Optional[str]) -> bool:
    names = {served_name, served_name.rstrip("/")}
    if model_path:
        names |= {model_path, model_path.rstrip("/")}
    return model in names or model.rstrip("/") in names


# ------------------------------------------------------------------ scalar checks
def get_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be a boolean, got {value!r}.", name)
    return value


def get_int(body: Mapping[str, Any], name: str, low: int, high: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{name} must be an integer, got {value!r}.", name)
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(f"{name} must be {'in ' if high is not None else ''}{allowed}, got {value}.", name)
    return value


def get_number(body: Mapping[str, Any], name: str, low: float, high: float) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {value!r}.", name)
    if not low <= value <= high:
        raise invalid(f"{name} must be in [{low:g}, {high:g}], got {value:g}.", name)
    return value


def stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`; stream_options without stream is refused, as by OpenAI."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                      "stream_options")
    if not isinstance(options, dict):
        raise invalid(f"stream_options must be an object, got {type(options).__name__}.", "stream_options")
    for key in options:
        if key != "include_usage":
            raise invalid(f"Unknown field 'stream_options.{key}'. Supported: include_usage.", "stream_options")
    return get_bool(options, "include_usage")


# ------------------------------------------------------------------ sampling params
_PASS_THROUGH_NUMBERS = {  # OpenAI name -> (SGLang name, low, high)
    "temperature": ("temperature", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "min_p": ("min_p", 0.0, 1.0),
    "frequency_penalty": ("frequency_penalty", -2.0, 2.0),
    "presence_penalty": ("presence_penalty", -2.0, 2.0),
    "repetition_penalty": ("repetition_penalty", 0.0, 2.0),
}
_PASS_THROUGH_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")


def sampling_params(body: Mapping[str, Any], max_tokens: Optional[int]) -> Dict[str, Any]:
    """SGLang `sampling_params` holding only what the client set (explicit keys matter to the
    context-length check); `max_tokens` is already resolved by the endpoint."""
    user = body.get("user")  # an end-user id for the caller's own tracking: checked, not used
    if user is not None and not isinstance(user, str):
        raise invalid(f"user must be a string, got {type(user).__name__}.", "user")
    params: Dict[str, Any] = {}
    if max_tokens is not None:
        params["max_new_tokens"] = max_tokens
    for name, (target, low, high) in _PASS_THROUGH_NUMBERS.items():
        value = get_number(body, name, low, high)
        if value is not None:
            params[target] = value
    top_k = get_int(body, "top_k", -1)
    if top_k is not None:
        if top_k == 0:
            raise invalid("top_k must be -1 (disabled) or >= 1, got 0.", "top_k")
        params["top_k"] = top_k
    min_tokens = get_int(body, "min_tokens", 0)
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise invalid(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).", "min_tokens")
        params["min_new_tokens"] = min_tokens
    n = get_int(body, "n", 1, MAX_N)
    if n is not None:
        params["n"] = n
    seed = get_int(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        params["sampling_seed"] = seed
    for name in _PASS_THROUGH_BOOLS:
        if body.get(name) is not None:
            params[name] = get_bool(body, name)
    stop = _stop(body.get("stop"))
    if stop:
        params["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid(f"stop_token_ids must be a list of integer token ids, got {ids!r}.", "stop_token_ids")
        params["stop_token_ids"] = ids
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        params["logit_bias"] = bias
    return params


def _stop(value: Any) -> Optional[list]:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}.", "stop")
    return stops


def _logit_bias(value: Any) -> Optional[Dict[str, float]]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"logit_bias must be an object mapping token ids to biases, got {value!r}.", "logit_bias")
    for key, bias in value.items():
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key!r}.",
                          "logit_bias")
    return value
