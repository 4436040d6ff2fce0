"""The request-body scan (srt/entrypoints/json_body.py) against a walk of the parsed value: the
same nesting depth and the same count of containers and object keys, strings with escapes and
structural characters included."""

from __future__ import annotations

import asyncio
import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from managers.generate_input import RequestError
from srt.entrypoints.json_body import MAX_JSON_DEPTH, SCAN_MIN_BYTES, json_depth, parse_json_body, structure_of

_tricky = st.text(alphabet='ab"\\{}[]:,\n\u00e9\u4e2d', max_size=12)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | _tricky,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_tricky, inner, max_size=5),
    max_leaves=40)


def walk(value, depth=1):
    """(deepest nesting, containers + keys) of a parsed value: the oracle."""
    if isinstance(value, dict):
        parts = [walk(v, depth + 1) for v in value.values()]
        return max([depth] + [p[0] for p in parts]), 1 + len(value) + sum(p[1] for p in parts)
    if isinstance(value, list):
        parts = [walk(v, depth + 1) for v in value]
        return max([depth] + [p[0] for p in parts]), 1 + sum(p[1] for p in parts)
    return 0, 0


@settings(max_examples=400, deadline=None)
@given(_json, st.booleans())
def test_scan_equals_the_walk_of_the_parsed_value(value, ascii_only):
    raw = json.dumps(value, ensure_ascii=ascii_only, indent=None).encode()
    depth, items = walk(value)
    assert structure_of(raw) == (depth, items)
    assert json_depth(value, 1000) == depth


def test_escaped_backslashes_before_quotes():
    value = {"a": "x\\", "b": ["\\\\\"", "{[\\\"]}"], "c": "\\\\"}
    raw = json.dumps(value).encode()
    assert structure_of(raw) == walk(value)


def test_big_bodies_go_through_the_scan_and_are_refused_by_it():
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    padded = b'{"pad": "' + b" " * SCAN_MIN_BYTES + b'", "x": ' + deep + b"}"
    with pytest.raises(RequestError, match="more than 64 levels deep"):
        asyncio.run(parse_json_body(padded, None))
    many = b'{"x": [' + b"{}," * 1000 + b"{}]}" + b" " * SCAN_MIN_BYTES
    with pytest.raises(RequestError, match=r"holds 1004 JSON objects.*--max-request-json-items=1000\)"):
        asyncio.run(parse_json_body(many, 1000))
    assert asyncio.run(parse_json_body(many, 1004)) == orjson.loads(many)


def test_small_bodies_are_walked_for_depth():
    deep = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(RequestError, match="more than 64 levels deep"):
        asyncio.run(parse_json_body(deep, None))
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert asyncio.run(parse_json_body(ok, None)) is not None
