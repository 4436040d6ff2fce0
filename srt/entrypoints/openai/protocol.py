"""OpenAI request validation: each field by its rule in `fields.py` (implemented, inert or taken at
its default only), types and ranges, and the mapping of OpenAI sampling fields onto SGLang
`sampling_params`. Any field outside the tables is an unknown field.
"""

from __future__ import annotations

import json

import math
from typing import Any, Dict, List, Mapping, Optional, Union

from aiohttp import web

from managers.generate_input import RequestError, check_field_rule
from srt.entrypoints import http_server
from srt.entrypoints.openai.fields import STREAM_OPTIONS_FIELDS
from srt.sampling.sampling_params import IMPLEMENTED, DefaultOnly
from srt.server_args import flag_default
from srt.utils.bounded_repr import bounded_repr



def invalid(message: str, param: Optional[str] = None) -> RequestError:
    return RequestError(message, 400, code="invalid_request_error", param=param)


async def read_json_body(request: web.Request) -> Dict[str, Any]:
    """The request body as a JSON object: the server's body reader (400 for empty, non-UTF-8 or
    malformed JSON, 413 over the size cap), then a 400 for anything but an object."""
    body = await http_server.read_json_body(request)
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def check_fields(body: Mapping[str, Any], table: Mapping[str, Any], endpoint: str) -> None:
    """Refuse unknown fields, and fields taken at their default only that carry another value, by name."""
    for key, value in body.items():
        rule = table.get(key)
        if rule is None:
            supported = sorted(k for k, r in table.items() if not isinstance(r, DefaultOnly))
            raise invalid(f"Unknown field '{key}' for {endpoint}. Supported fields: {', '.join(supported)}.", key)
        if rule is IMPLEMENTED:
            continue
        if isinstance(rule, DefaultOnly) and rule.feature and not rule.accepts(value):
            raise invalid(f"'{key}' is not supported by this server yet ({endpoint}); remove it from the "
                          f"request.", key)
        check_field_rule(key, value, rule)


def check_model(body: Mapping[str, Any]) -> None:
    """`model` may name any model, as with SGLang: the response reports the served model name."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid(f"model must be a string, got {type(model).__name__}.", "model")


def client_rid(body: Mapping[str, Any], num_prompts: int) -> Optional[Union[str, List[str]]]:
    """SGLang's `rid`: one string (a batch's prompts become `<rid>_<i>`) or one string per prompt."""
    rid = body.get("rid")
    if rid is None:
        return None
    if isinstance(rid, str) and rid:
        return rid if num_prompts == 1 else [f"{rid}_{i}" for i in range(num_prompts)]
    if isinstance(rid, list) and len(rid) == num_prompts and all(isinstance(r, str) and r for r in rid):
        return rid[0] if num_prompts == 1 else rid
    raise invalid(f"rid must be a non-empty string or a list of {num_prompts} non-empty strings (one per prompt), "
                  f"got {bounded_repr(rid)}.", "rid")


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
        raise invalid(f"{name} must be a boolean, got {bounded_repr(value)}.", name)
    return value


def get_int(body: Mapping[str, Any], name: str, low: int, high: Optional[int] = None,
            flag: Optional[str] = None) -> Optional[int]:
    """`body[name]` as an int in [low, high]; `flag` names the server flag that sets `high`."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise invalid(f"{name} must be an integer, got {bounded_repr(value)}.", name)
    if value < low or (high is not None and value > high):
        allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
        where = f" (the upper bound is this server's {flag}={high})" if flag and high is not None and value > high else ""
        raise invalid(f"{name} must be {'in ' if high is not None else ''}{allowed}{where}, got {bounded_repr(value)}.",
                      name)
    return value


def max_logprobs(state: Any) -> int:
    """--max-logprobs: the most top logprobs per token a request may ask for."""
    value = getattr(state.server_args, "max_logprobs", None)
    return int(flag_default("max_logprobs") if value is None else value)


def get_number(body: Mapping[str, Any], name: str, low: float, high: float) -> Optional[float]:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise invalid(f"{name} must be a finite number, got {bounded_repr(value)}.", name)
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
    for key, value in options.items():
        rule = STREAM_OPTIONS_FIELDS.get(key)
        if rule is None:
            raise invalid(f"Unknown field 'stream_options.{key}'. Supported: {', '.join(STREAM_OPTIONS_FIELDS)}.",
                          "stream_options")
        if rule is not IMPLEMENTED:
            check_field_rule(f"stream_options.{key}", value, rule)
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
    n = get_int(body, "n", 1)  # the upper bound is the server's --max-n, checked with the batch
    if n is not None:
        params["n"] = n
    seed = get_int(body, "seed", -(1 << 63), (1 << 64) - 1)
    if seed is not None:
        params["sampling_seed"] = seed
    for name in _PASS_THROUGH_BOOLS:
        if body.get(name) is not None:
            params[name] = get_bool(body, name)
    for name in ("stop", "stop_regex"):
        stops = _stop(body.get(name), name)
        if stops:
            params[name] = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid(f"stop_token_ids must be a list of integer token ids, got {bounded_repr(ids)}.", "stop_token_ids")
        params["stop_token_ids"] = ids
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        params["logit_bias"] = bias
    params.update(grammar_params(body))
    return params


def grammar_params(body: Mapping[str, Any]) -> Dict[str, str]:
    """The constraint of an OpenAI request as sampling params: SGLang's `regex` / `ebnf` /
    `json_schema` fields, or OpenAI's `response_format` (`json_object`: any JSON object;
    `json_schema`: its `json_schema.schema`). At most one; each compiled by the front end."""
    out: Dict[str, str] = {}
    given = [name for name in ("regex", "ebnf", "json_schema") if body.get(name) is not None]
    if body.get("response_format") not in (None, {"type": "text"}):
        given.append("response_format")
    if len(given) > 1:
        raise invalid(f"regex, ebnf, json_schema and response_format are mutually exclusive, got "
                      f"{' and '.join(given)}.", given[1])
    for name in ("regex", "ebnf", "json_schema"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, dict) and name == "json_schema":
            value = json.dumps(value)
        if not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {type(value).__name__}.", name)
        out[name] = value
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise invalid(f"response_format must be an object with a type, got {bounded_repr(fmt)}.", "response_format")
        kind = fmt["type"]
        if kind == "json_object":
            out["json_schema"] = json.dumps({"type": "object"})
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, bool)):
                raise invalid("response_format.json_schema.schema must be a JSON schema object, got "
                              f"{bounded_repr(schema)}.", "response_format")
            out["json_schema"] = json.dumps(schema)
        elif kind == "structural_tag":  # SGLang's: {type, structures: [{begin, schema, end}], triggers}
            out["structural_tag"] = json.dumps({"structures": fmt.get("structures"), "triggers": fmt.get("triggers")})
        elif kind != "text":
            raise invalid(f"response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                          f"got {bounded_repr(kind)}.", "response_format")
    return out


def _stop(value: Any, name: str) -> Optional[list]:
    if value is None:
        return None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"{name} must be a non-empty string or a list of non-empty strings, got {bounded_repr(value)}.", name)
    return stops


def _logit_bias(value: Any) -> Optional[Dict[str, float]]:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(f"logit_bias must be an object mapping token ids to biases, got {bounded_repr(value)}.", "logit_bias")
    for key, bias in value.items():
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100 <= bias <= 100:
            raise invalid(f"logit_bias values must be numbers in [-100, 100], got {bounded_repr(bias)} for token {bounded_repr(key)}.",
                          "logit_bias")
    return value
