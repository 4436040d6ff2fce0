"""A repr of a client's value short enough to echo in an error message: a 10 MB string or a
million-element list sent in the wrong field must not come back in the 400 (or fill the logs)."""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxdict = 8
_REPR.maxlevel = 3
_REPR.maxlong = 40

MAX_ERROR_MESSAGE_CHARS = 2000  # the backstop at the HTTP boundary for messages built elsewhere


def bounded_repr(value: Any) -> str:
    """`repr(value)` with strings, numbers and containers elided past a few dozen characters."""
    return _REPR.repr(value)


def bound_message(message: str) -> str:
    if len(message) <= MAX_ERROR_MESSAGE_CHARS:
        return message
    cut = len(message) - MAX_ERROR_MESSAGE_CHARS
    return message[:MAX_ERROR_MESSAGE_CHARS] + f"... ({cut} more characters not shown)"
