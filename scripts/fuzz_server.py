"""Fuzz every route of a running server with generated and mutated bodies (hypothesis).

    python scripts/fuzz_server.py --url http://127.0.0.1:30000 -n 2000
    python scripts/fuzz_server.py --model-path DIR -n 2000      # launches a small-limit server

Bodies come from the server's own field tables (GENERATE_FIELDS, SAMPLING_FIELDS,
COMPLETION_FIELDS, CHAT_FIELDS): known fields with plausible, boundary and wrongly typed values,
unknown fields, random JSON, and byte-level mutations of valid bodies (truncation, flips, deep
nesting). Every answer must be a JSON 4xx error or a valid 200 (a stream ends with [DONE])
within `--deadline-s`; never a 5xx, never a hang. Afterwards the server must be healthy, idle,
and conserve its KV pool. Prints a table of statuses per route; exits 1 on the first violation
(hypothesis shrinks it to a minimal body first, and the body is printed).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from managers.generate_input import GENERATE_FIELDS  # noqa: E402
from server_process import LaunchedServer, split_server_args  # noqa: E402
from soak_evil import CATASTROPHIC_REGEXES, LIST_EBNF, YES_NO_EBNF  # noqa: E402
from srt.entrypoints.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS  # noqa: E402
from srt.sampling.sampling_params import SAMPLING_FIELDS  # noqa: E402

# Small limits keep every accepted request short (a 200 must come back within the deadline).
FUZZ_SERVER_ARGS = ["--context-length", "96", "--max-batch-items", "8", "--max-n", "4",
                    "--max-queued-requests", "64"]

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63 - 1),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=12)
# Values a field is likely to meet: boundaries, off-by-one, wrong types of the right shape.
EDGE_VALUES = st.sampled_from([0, 1, 2, -1, 3, 64, 95, 96, 97, 10**9, -10**9, 0.0, 0.5, 1.0, 1.5, 2.0, -0.5,
                               True, False, None, "", "a", "hi", "5", [], [0], [1, 2], [-1], [10**6], {}, {"a": 1},
                               ["x"], "[a-z]+", '{"type": "object"}', "root ::= \"a\""])
# The evil mix (scripts/soak_evil.py): catastrophic patterns, values at and past every cap.
EVIL_VALUES = st.sampled_from(CATASTROPHIC_REGEXES + [
    YES_NO_EBNF, LIST_EBNF, r"(a)\1", "(?=a)", 20, 21, 2048, 4096, 4097, "z" * 3000, "x" * 5000,
    [f"s{i}" for i in range(65)], ["a+"] * 64, {str(i): 1 for i in range(4097)}, list(range(21))])
FIELD_VALUES = st.one_of(EDGE_VALUES, EDGE_VALUES, EVIL_VALUES, JSON_VALUES)
PROMPTS = st.one_of(st.text(min_size=1, max_size=60), st.sampled_from(["Hello", "a b c", "日本語", "\u0000", " "]))
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                    "content": st.one_of(PROMPTS, JSON_VALUES)}), max_size=3),
    JSON_VALUES)


def _short(max_tokens_field: str) -> Dict[str, Any]:
    return {max_tokens_field: st.integers(0, 8)}


@st.composite
def route_body(draw: Any) -> Tuple[str, str, Any]:
    """(method, path, body) where body is a dict/list/scalar (sent as JSON) or raw bytes."""
    route = draw(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request",
                                  "/flush_cache", "GET"]))
    if route == "GET":
        path = draw(st.sampled_from(["/health", "/health_generate", "/ready", "/get_model_info",
                                     "/get_server_info", "/get_load", "/v1/models", "/v1/models/x", "/nope",
                                     "/metrics"]))
        return "GET", path, None
    kind = draw(st.sampled_from(["fields", "fields", "fields", "random", "bytes"]))
    if kind == "random":
        return "POST", route, draw(JSON_VALUES)
    body = _fields_body(draw, route)
    if kind == "bytes":
        return "POST", route, _mutate_bytes(draw, json.dumps(body).encode())
    return "POST", route, body


def _fields_body(draw: Any, route: str) -> Dict[str, Any]:
    tables = {"/generate": GENERATE_FIELDS, "/v1/completions": COMPLETION_FIELDS,
              "/v1/chat/completions": CHAT_FIELDS, "/abort_request": {"rid": 1, "abort_all": 1},
              "/flush_cache": {}}
    table = tables[route]
    base: Dict[str, Any] = {}
    if route == "/generate":
        base = {"text": draw(PROMPTS), "sampling_params": {"max_new_tokens": draw(st.integers(0, 8))}}
    elif route == "/v1/completions":
        base = {"model": "m", "prompt": draw(PROMPTS), "max_tokens": draw(st.integers(0, 8))}
    elif route == "/v1/chat/completions":
        base = {"model": "m", "messages": draw(MESSAGES), "max_tokens": draw(st.integers(0, 8))}
    names = sorted(table)
    for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)) if names else []:
        base[name] = draw(FIELD_VALUES)
    if route == "/generate" and isinstance(base.get("sampling_params"), dict) and draw(st.booleans()):
        for name in draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), max_size=4, unique=True)):
            base["sampling_params"][name] = draw(FIELD_VALUES)
    if draw(st.integers(0, 9)) == 0:
        base[draw(st.text(min_size=1, max_size=10))] = draw(FIELD_VALUES)  # most likely unknown
    return base


def _mutate_bytes(draw: Any, raw: bytes) -> bytes:
    how = draw(st.sampled_from(["truncate", "flip", "nest", "insert"]))
    if how == "truncate" and raw:
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        return raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    if how == "nest":
        depth = draw(st.integers(30, 3000))
        return b'{"text": "a", "rid": ' + b"[" * depth + b"]" * depth + b"}"
    i = draw(st.integers(0, len(raw)))
    return raw[:i] + draw(st.binary(min_size=1, max_size=8)) + raw[i:]


class FuzzRun:
    """Sends one generated case and judges the answer; keeps the tallies for the table."""

    def __init__(self, url: str, deadline_s: float):
        self.url, self.deadline_s = url, deadline_s
        self.statuses: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.sent = 0

    def check(self, method: str, path: str, body: Any) -> None:
        self.sent += 1
        start = time.monotonic()
        kw: Dict[str, Any] = {"timeout": self.deadline_s}
        if body is not None:
            kw["data"] = body if isinstance(body, bytes) else json.dumps(body).encode()
            kw["headers"] = {"Content-Type": "application/json"}
        try:
            resp = requests.request(method, self.url + path, stream=True, **kw)
            content = resp.raw.read(decode_content=True) if resp.status_code == 200 else resp.content
        except requests.Timeout:
            raise AssertionError(f"{method} {path}: no answer within {self.deadline_s:.0f} s") from None
        elapsed = time.monotonic() - start
        self.statuses[path if method == "POST" else "GET " + path][resp.status_code] += 1
        assert elapsed < self.deadline_s, f"{method} {path}: {elapsed:.1f} s"
        assert resp.status_code < 500 or (path == "/health_generate" and resp.status_code == 503), (
            f"{method} {path} -> {resp.status_code}: {content[:300]!r}")
        ctype = resp.headers.get("Content-Type", "")
        if resp.status_code >= 400 and path != "/nope":
            error = json.loads(content)["error"]
            assert isinstance(error["message"], str) and len(error["message"]) < 2500, error
        elif resp.status_code == 200 and ctype.startswith("text/event-stream"):
            assert content.rstrip().endswith(b"data: [DONE]"), f"{path}: stream without [DONE]: {content[-200:]!r}"
        elif resp.status_code == 200 and ctype.startswith("application/json"):
            json.loads(content)


def fuzz(run: FuzzRun, num_examples: int, seed: int = 0) -> FuzzRun:
    """`num_examples` generated cases through `run.check`; a violation raises (shrunk first)."""

    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    @given(route_body())
    def case(rb: Tuple[str, str, Any]) -> None:
        run.check(*rb)

    hyp_seed(seed)(case)()
    return run


def check_healthy_after(url: str, timeout: float = 120.0) -> List[str]:
    """Problems with the server after the fuzz: health, idleness, KV conservation."""
    problems: List[str] = []
    if requests.get(url + "/health_generate", timeout=60).status_code != 200:
        problems.append("/health_generate is not 200 after the fuzz")
    deadline = time.monotonic() + timeout
    while True:
        info = requests.get(url + "/get_server_info", timeout=30).json()
        load = info.get("load") or {}
        idle = not load.get("num_running_reqs") and not load.get("num_waiting_reqs") and not info["num_front_end_requests"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if not idle:
        problems.append(f"not idle after the fuzz: {load}")
    m = load.get("memory") or {}
    if m.get("available_size", 0) + m.get("evictable_size", 0) + m.get("protected_size", 0) != \
            info["max_total_num_tokens"] or m.get("protected_size") or m.get("num_free_req_slots") != m.get("num_req_slots"):
        problems.append(f"KV conservation broken after the fuzz: {m} of T = {info['max_total_num_tokens']}")
    return problems


def format_table(run: FuzzRun) -> str:
    codes = sorted({c for counter in run.statuses.values() for c in counter})
    lines = ["| route | " + " | ".join(str(c) for c in codes) + " |", "|---" * (len(codes) + 1) + "|"]
    for route in sorted(run.statuses):
        lines.append(f"| {route} | " + " | ".join(str(run.statuses[route][c]) for c in codes) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    own, server_args = split_server_args(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url")
    ap.add_argument("--model-path")
    ap.add_argument("-n", "--num-examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline-s", type=float, default=60.0)
    args = ap.parse_args(own)
    server = None
    if args.url is None:
        if not args.model_path:
            ap.error("give --url of a running server or --model-path to launch one")
        server = LaunchedServer(args.model_path, FUZZ_SERVER_ARGS + server_args)
    url = args.url or server.url
    try:
        start = time.monotonic()
        run, problems = FuzzRun(url, args.deadline_s), []
        try:
            fuzz(run, args.num_examples, args.seed)
        except AssertionError as exc:
            problems.append(f"violation: {exc}")
        problems += check_healthy_after(url)
        print(format_table(run))
        print(f"\n{run.sent} requests in {time.monotonic() - start:.1f} s")
        print("PASS" if not problems else "FAIL: " + "; ".join(problems))
        return 0 if not problems else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
