"""The expressions a frontend program is made of, and `SglFunction` (what `@function` returns).

A program is a Python function whose first argument `s` is its state; `s += expr` appends an
expression: constant text, `gen`, `select`, a role boundary, a variable scope boundary. The
names follow SGLang's `sglang.lang.ir`, so a program ports by changing its import.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable, Dict, List, Optional, Union

REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "bool": REGEX_BOOL, "str": REGEX_STR}


def dtype_name(dtype: Union[type, str, None]) -> Optional[str]:
    if dtype is None:
        return None
    name = dtype.__name__ if isinstance(dtype, type) else str(dtype)
    if name not in _DTYPE_REGEX:
        raise ValueError(f"gen(dtype={dtype!r}) is not supported; use one of int, float, bool, str.")
    return name


@dataclasses.dataclass
class SglSamplingParams:
    """Sampling parameters of one `gen`; `None` means "inherit" when a gen overrides run(...)'s."""

    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    n: Optional[int] = None
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[int]] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    return_logprob: Optional[bool] = None
    logprob_start_len: Optional[int] = None
    top_logprobs_num: Optional[int] = None
    return_text_in_logprobs: Optional[bool] = None
    dtype: Optional[str] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None

    def merged_over(self, base: "SglSamplingParams") -> "SglSamplingParams":
        """`base` with every field this one sets replaced (gen's arguments over run's)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(base, **{k: v for k, v in values.items() if v is not None})

    def to_request(self, extra_stop: List[str]) -> Dict[str, Any]:
        """The native `/generate` body fields (sampling params + logprob options) for this gen."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        regex = self.regex
        if self.dtype is not None:
            regex = _DTYPE_REGEX[self.dtype]
            if self.dtype in ("int", "float"):
                stop += [" ", "\n"]
        stop += [x for x in extra_stop if x not in stop]
        params = {
            "max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens, "n": self.n,
            "stop": stop, "stop_token_ids": list(self.stop_token_ids or []), "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos, "regex": regex, "json_schema": self.json_schema,
        }
        body: Dict[str, Any] = {"sampling_params": {k: v for k, v in params.items() if v is not None}}
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        return body


def run_defaults(max_new_tokens: int = 128, stop=(), stop_token_ids=(), temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0, frequency_penalty: float = 0.0,
                 presence_penalty: float = 0.0, ignore_eos: bool = False, return_logprob=None,
                 logprob_start_len=None, top_logprobs_num=None, return_text_in_logprobs=None) -> SglSamplingParams:
    """The sampling defaults of one run (SGLang's: 128 new tokens, temperature 1)."""
    return SglSamplingParams(
        max_new_tokens=max_new_tokens, stop=list(stop) if not isinstance(stop, str) else stop,
        stop_token_ids=list(stop_token_ids), temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs)


class SglExpr:
    """Something a program appends to its state; `a + b` builds a list executed in order."""

    def __add__(self, other):
        return SglExprList([self, as_expr(other)])

    def __radd__(self, other):
        return SglExprList([as_expr(other), self])


def as_expr(value) -> SglExpr:
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"cannot add {type(value).__name__} to a program: use str or an sgl expression")


class SglExprList(SglExpr):
    def __init__(self, exprs: List[SglExpr]):
        exprs = [as_expr(x) for x in exprs]
        self.exprs = [e for x in exprs for e in (x.exprs if isinstance(x, SglExprList) else [x])]


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        self.value = value


class SglGen(SglExpr):
    def __init__(self, name: Optional[str], sampling_params: SglSamplingParams):
        self.name = name
        self.sampling_params = sampling_params


class SglSelect(SglExpr):
    def __init__(self, name: Optional[str], choices: List[str], temperature: float, choices_method):
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError(f"select(choices=...) needs a non-empty list of strings, got {choices!r}")
        if temperature > 1e-5:
            raise ValueError(f"select(temperature={temperature}) is not supported: selection is by likelihood "
                             "(temperature 0) only.")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        self.role = role


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        self.role = role


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglCommitLazy(SglExpr):
    """Send the text so far as a prefill-only request, so what follows hits the prefix cache."""


def schema_text(json_schema) -> Optional[str]:
    if json_schema is None or isinstance(json_schema, str):
        return json_schema
    return json.dumps(json_schema)


class SglFunction:
    """A frontend program: `run` one, `run_batch` many, `bind` some arguments in advance."""

    def __init__(self, func: Callable, bind_arguments: Optional[Dict[str, Any]] = None):
        self.func = func
        self.bind_arguments = dict(bind_arguments or {})
        names = func.__code__.co_varnames[:func.__code__.co_argcount]
        if not names or names[0] != "s":
            raise TypeError(f"@function {func.__name__}: the first argument must be the state `s`, got {names}")
        self.arg_names = list(names[1:])

    def bind(self, **kwargs) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.func.__name__}.bind(): unknown argument(s) {unknown}; it takes {self.arg_names}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def run(self, *args, backend=None, stream: bool = False, **kwargs):
        from srt.lang.run import run_program

        sampling, func_kwargs = _split_run_kwargs(kwargs)
        return run_program(self, backend, args, func_kwargs, run_defaults(**sampling), stream)

    def run_batch(self, batch_kwargs: List[Dict[str, Any]], *, backend=None, num_threads: Union[int, str] = "auto",
                  progress_bar: bool = False, generator_style: bool = False, **kwargs):
        from srt.lang.run import run_program_batch

        sampling, extra = _split_run_kwargs(kwargs)
        if extra:
            raise TypeError(f"run_batch(): unknown keyword(s) {sorted(extra)}; program arguments go in the list")
        if not isinstance(batch_kwargs, list) or not all(isinstance(x, dict) for x in batch_kwargs):
            raise TypeError("run_batch() takes a list of dicts of program arguments")
        return run_program_batch(self, backend, batch_kwargs, run_defaults(**sampling), num_threads,
                                 progress_bar, generator_style)

    def __call__(self, *args, **kwargs):
        raise TypeError(f"call {self.func.__name__}.run(...) to run a program (a program is not a plain function)")


_RUN_SAMPLING = ("max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
                 "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs")


def _split_run_kwargs(kwargs: Dict[str, Any]):
    sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in _RUN_SAMPLING}
    return sampling, kwargs
