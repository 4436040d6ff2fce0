"""`stop_regex` patterns, compiled with RE2 (google-re2): matching takes time linear in the text
whatever the pattern, so no request can make the scheduler backtrack. RE2 refuses what needs
backtracking (backreferences, lookarounds) and patterns over its memory budget; those requests are
refused with a 400 naming `stop_regex`.

How much output a pattern sees: its longest possible match when that is bounded, else the text of
the last `STOP_REGEX_TAIL_TOKENS` tokens (docs/architecture.md, "Stop conditions").
"""

from __future__ import annotations

import functools
import re
from typing import Any, Optional

import re2

try:
    from re import _parser as sre_parse  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse

# Output tokens an unbounded pattern (`a+b`, `.*x`) is matched against at each step.
STOP_REGEX_TAIL_TOKENS = 64
# A match of w characters spans at most 4 * w tokens (a token decodes to at least one UTF-8 byte).
_BYTES_PER_CHAR = 4
# RE2's program memory per pattern (its default is 8 MiB); a pattern past it is refused.
RE2_MAX_MEM = 8 << 20


class StopRegexError(ValueError):
    """A pattern RE2 cannot compile; the message names the pattern's problem."""


def _options() -> Any:
    options = re2.Options()
    options.log_errors = False  # the refusal goes to the client, not to stderr
    options.max_mem = RE2_MAX_MEM
    return options


@functools.lru_cache(maxsize=1024)
def compile_stop_regex(pattern: str) -> Any:
    """The compiled pattern (cached: the front end's check and the scheduler's compile share it)."""
    try:
        return re2.compile(pattern, options=_options())
    except re2.error as exc:
        detail = exc.args[0] if exc.args else exc
        if isinstance(detail, bytes):
            detail = detail.decode("utf-8", "replace")
        raise StopRegexError(f"{detail} (stop_regex runs on RE2: no backreferences or lookarounds)") from None


@functools.lru_cache(maxsize=1024)
def max_match_chars(pattern: str) -> Optional[int]:
    """The longest text `pattern` can match, in characters; None when unbounded (or unknown)."""
    try:
        _, high = sre_parse.parse(pattern).getwidth()  # Python's parser: linear, never matches
    except (re.error, RecursionError, OverflowError, AttributeError):
        return None
    return None if high >= STOP_REGEX_TAIL_TOKENS * _BYTES_PER_CHAR else high


def tail_tokens(pattern: str) -> int:
    """Output tokens decoded to look for `pattern` (at most `STOP_REGEX_TAIL_TOKENS`)."""
    width = max_match_chars(pattern)
    return STOP_REGEX_TAIL_TOKENS if width is None else min(STOP_REGEX_TAIL_TOKENS, max(width, 1) * _BYTES_PER_CHAR)
