"""Request bodies: read, bounded and parsed without holding the event loop.

A body's cost to parse is set by how many JSON containers and object keys it holds, not by its
size: 27 MB of 900k chat messages takes orjson about a second (GIL held), 30 MB of one string a few
tens of milliseconds. So a body over `SCAN_MIN_BYTES` is first scanned for its nesting depth and its
number of containers and keys with numpy (which releases the GIL, in a worker thread), and only
parsed when both are in bounds; a smaller one is parsed at once and its depth walked in Python.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Tuple

import numpy as np
import orjson

from managers.generate_input import RequestError
from srt.server_args import flag_default

MAX_JSON_DEPTH = 64  # deeper bodies are refused: error messages and validators recurse over values
SCAN_MIN_BYTES = 1 << 16  # below this, parsing and walking costs well under a millisecond

_QUOTE, _BACKSLASH, _COLON = 34, 92, 58
_OPENERS, _CLOSERS = (123, 91), (125, 93)  # { [  and  } ]
# One scan at a time: a 32 MiB body needs ~150 MiB of temporaries.
_SCANNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="json-scan")


def structure_of(raw: bytes) -> Tuple[int, int]:
    """(deepest nesting, containers + object keys) of a JSON text, counting only bytes outside
    strings. Exact for valid JSON; for invalid JSON a bound that the parser then refuses anyway."""
    a = np.frombuffer(raw, dtype=np.uint8)
    if a.size == 0:
        return 0, 0
    quote = a == _QUOTE
    if (a == _BACKSLASH).any():
        _drop_escaped_quotes(a, quote)
    # Every step below is a numpy loop that releases the GIL (a bool -> int32 cumsum does not:
    # it casts in buffered chunks under the GIL), so the event loop runs beside the scan.
    inside = np.bitwise_xor.accumulate(quote.view(np.uint8))  # 1 from an opening quote to its closing one
    outside = inside == 0
    opens = ((a == _OPENERS[0]) | (a == _OPENERS[1])) & outside
    closes = ((a == _CLOSERS[0]) | (a == _CLOSERS[1])) & outside
    step = opens.view(np.int8) - closes.view(np.int8)
    steps = step[np.flatnonzero(step)].astype(np.int32)
    depth = int(np.add.accumulate(steps, dtype=np.int32).max()) if steps.size else 0
    items = int(np.count_nonzero(opens)) + int(np.count_nonzero((a == _COLON) & outside))
    return max(depth, 0), items


def _drop_escaped_quotes(a: np.ndarray, quote: np.ndarray) -> None:
    """Clear the quotes preceded by an odd run of backslashes (they are inside a string)."""
    candidates = np.flatnonzero(quote[1:] & (a[:-1] == _BACKSLASH)) + 1
    run = np.zeros(candidates.size, dtype=np.int64)
    active = np.ones(candidates.size, dtype=bool)
    k = 1
    while active.any():
        pos = candidates - k
        still = active & (pos >= 0)
        still[still] = a[pos[still]] == _BACKSLASH
        run += still
        active, k = still, k + 1
    quote[candidates[(run & 1) == 1]] = False


def json_depth(value: Any, limit: int) -> int:
    """How deep `value` nests (iteratively, stopping once past `limit`; scalars are not pushed)."""
    if not isinstance(value, (list, dict)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((v, depth + 1) for v in children if isinstance(v, (list, dict)))
    return deepest


def _too_deep() -> RequestError:
    return RequestError(f"The request body nests arrays or objects more than {MAX_JSON_DEPTH} levels deep; no "
                        "field of this API needs that many.", 400, code="invalid_request_error")


async def parse_json_body(raw: bytes, max_items: Optional[int]) -> Any:
    """The parsed body of a request; `RequestError` 400 when it is empty, not UTF-8, not JSON, too
    deep, or holds more than `max_items` containers and object keys (--max-request-json-items)."""
    if not raw.strip():
        raise RequestError("The request body is empty: send a JSON object.", 400, code="invalid_request_error")
    big = len(raw) >= SCAN_MIN_BYTES
    if big:
        depth, items = await asyncio.get_running_loop().run_in_executor(_SCANNER, structure_of, raw)
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        limit = flag_default("max_request_json_items") if max_items is None else max_items
        if items > limit:
            raise RequestError(
                f"The request body holds {items} JSON objects, arrays and keys, more than one request may hold "
                f"({limit}, --max-request-json-items={limit}); no request within this server's other limits "
                f"needs that many. Send a smaller request, or raise --max-request-json-items.", 400,
                code="invalid_request_error")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"The request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at position "
                           f"{exc.start}.", 400, code="invalid_request_error") from None
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"The request body is not valid JSON: {exc}.", 400, code="invalid_request_error") from None
    if not big and json_depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise _too_deep()
    return body
