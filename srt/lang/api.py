"""The functions programs are written with: `function`, `gen`, `select`, roles, and friends."""

from __future__ import annotations

import re
from typing import Callable, List, Optional, Union

from srt.lang.choices import token_length_normalized
from srt.lang.ir import (SglExprList, SglFunction, SglGen, SglRoleBegin, SglRoleEnd, SglSamplingParams, SglSelect,
                         dtype_name, schema_text)
from srt.lang.run import resolve_backend


def function(func: Optional[Callable] = None, **kwargs):
    """`@function` (or `@function()`): turn `def prog(s, ...)` into a runnable program."""
    if kwargs.get("num_api_spec_tokens") is not None:
        raise ValueError("function(num_api_spec_tokens=...) is for API models SGLang proxies; not supported here")
    if func is None:
        return lambda f: SglFunction(f)
    return SglFunction(func)


def gen(name: Optional[str] = None, max_tokens: Optional[int] = None, min_tokens: Optional[int] = None,
        n: Optional[int] = None, stop: Union[str, List[str], None] = None, stop_token_ids: Optional[List[int]] = None,
        temperature: Optional[float] = None, top_p: Optional[float] = None, top_k: Optional[int] = None,
        min_p: Optional[float] = None, frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None, ignore_eos: Optional[bool] = None,
        return_logprob: Optional[bool] = None, logprob_start_len: Optional[int] = None,
        top_logprobs_num: Optional[int] = None, return_text_in_logprobs: Optional[bool] = None,
        dtype: Union[type, str, None] = None, choices: Optional[List[str]] = None, choices_method=None,
        regex: Optional[str] = None, json_schema=None):
    """Generate into variable `name`. With `choices`, this is `select`. `dtype` (int, float, bool,
    str) constrains the text to that type's literal; `regex` / `json_schema` constrain it too."""
    if choices:
        return select(name, choices, 0.0 if temperature is None else temperature, choices_method)
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            raise ValueError(f"gen(regex={regex!r}) is not a valid regular expression: {exc}") from exc
    params = SglSamplingParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=stop, stop_token_ids=stop_token_ids,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, dtype=dtype_name(dtype), regex=regex,
        json_schema=schema_text(json_schema))
    return SglGen(name, params)


def gen_int(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs):
    return gen(name, max_tokens=max_tokens, dtype=int, **kwargs)


def gen_string(name: Optional[str] = None, max_tokens: Optional[int] = None, **kwargs):
    return gen(name, max_tokens=max_tokens, dtype=str, **kwargs)


def select(name: Optional[str] = None, choices: Optional[List[str]] = None, temperature: float = 0.0,
           choices_method=None):
    """Pick the likeliest of `choices` after the text so far (scored by `choices_method`)."""
    return SglSelect(name, choices or [], temperature, choices_method or token_length_normalized)


def image(expr=None):
    raise NotImplementedError("image() is not supported: this runtime serves text-only models, so a program "
                              "cannot add images; remove the image or use a vision-language server.")


def video(*args, **kwargs):
    raise NotImplementedError("video() is not supported: this runtime serves text-only models.")


def _role(name: str, expr=None):
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    return SglExprList([SglRoleBegin(name), expr, SglRoleEnd(name)])


def system(expr=None):
    return _role("system", expr)


def user(expr=None):
    return _role("user", expr)


def assistant(expr=None):
    return _role("assistant", expr)


def system_begin():
    return SglRoleBegin("system")


def system_end():
    return SglRoleEnd("system")


def user_begin():
    return SglRoleBegin("user")


def user_end():
    return SglRoleEnd("user")


def assistant_begin():
    return SglRoleBegin("assistant")


def assistant_end():
    return SglRoleEnd("assistant")


def flush_cache(backend=None):
    return resolve_backend(backend).flush_cache()


def get_server_info(backend=None):
    return resolve_backend(backend).get_server_info()
