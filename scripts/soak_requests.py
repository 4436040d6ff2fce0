"""The soak's request mix: each kind builds a body, sends it with aiohttp and checks the answer.

One in ten is "evil" (scripts/soak_evil.py): catastrophic stop regexes, logprobs at and over the cap,
EBNF constraints, and the caps' refusals, which must name their flag.

Every request ends in one `Outcome`: `ok` (a valid answer of the right shape and length),
`refused` (a 4xx JSON error for a body meant to be refused), `shed` (a queue-full 503 with
Retry-After), `disconnected` (the client went away on purpose) or `failed` (anything else: a
5xx, a refused valid body, an accepted bad one, a wrong shape, a hang past the deadline).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Dict, List, Optional, Tuple

import aiohttp

from soak_evil import evil_refused, evil_served

WORDS = ("the cat sat on a warm mat while rain fell over quiet hills and a river ran "
         "past old stone walls toward the grey sea").split()


@dataclass
class Outcome:
    kind: str
    result: str  # ok | refused | shed | disconnected | failed
    status: int = 0
    detail: str = ""


@dataclass
class SoakConfig:
    context_len: int
    max_new_tokens: int = 8
    disconnect_frac: float = 0.3
    deadline_s: float = 120.0
    evil_frac: float = 0.1  # scripts/soak_evil.py: half refused, half served


def prompt(rng: random.Random, lo: int = 3, hi: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _sampling(rng: random.Random, m: int) -> Dict[str, Any]:
    params: Dict[str, Any] = {"max_new_tokens": m, "ignore_eos": True}
    if rng.random() < 0.5:
        params.update(temperature=0.8, top_p=0.9, top_k=20)
    else:
        params["temperature"] = 0
    return params


async def _read_sse(resp: aiohttp.ClientResponse, stop_after: Optional[int]) -> Tuple[List[Any], bool]:
    """The JSON events of an SSE body and whether `[DONE]` came; stops early after `stop_after`."""
    events: List[Any] = []
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                raise ValueError(f"not an SSE data line: {event[:80]!r}")
            data = event[6:]
            if data == b"[DONE]":
                return events, True
            events.append(json.loads(data))
            if stop_after is not None and len(events) >= stop_after:
                return events, False
    return events, False


def _expect_tokens(got: Any, want: int, what: str) -> Optional[str]:
    return None if got == want else f"{what}: {got} tokens, expected {want}"


# ---------------------------------------------------------------------- native /generate
def native_body(rng: random.Random, cfg: SoakConfig, variant: str) -> Dict[str, Any]:
    m = rng.randint(1, cfg.max_new_tokens)
    body: Dict[str, Any] = {"text": prompt(rng), "sampling_params": _sampling(rng, m)}
    if variant == "batch":
        body["text"] = [prompt(rng) for _ in range(rng.randint(2, 4))]
    elif variant == "n":
        body["sampling_params"].update(n=rng.randint(2, 3), temperature=0.7)
    elif variant == "logprobs":
        body.update(return_logprob=True, top_logprobs_num=2)
    elif variant == "stream":
        body["stream"] = True
    return body


def check_native(body: Dict[str, Any], answer: Any) -> Optional[str]:
    m = body["sampling_params"]["max_new_tokens"]
    n = body["sampling_params"].get("n", 1)
    prompts = len(body["text"]) if isinstance(body["text"], list) else 1
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != prompts * n:
        return f"{len(items)} results, expected {prompts * n}"
    for item in items:
        meta = item.get("meta_info", {})
        if not isinstance(item.get("text"), str):
            return "no text"
        problem = _expect_tokens(meta.get("completion_tokens"), m, "completion")
        if problem:
            return problem
        if body.get("return_logprob") and len(meta.get("output_token_logprobs") or []) != m:
            return f"output_token_logprobs has {len(meta.get('output_token_logprobs') or [])} entries, expected {m}"
    return None


# ---------------------------------------------------------------------- OpenAI
def openai_body(rng: random.Random, cfg: SoakConfig, chat: bool, stream: bool) -> Dict[str, Any]:
    m = rng.randint(1, cfg.max_new_tokens)
    body: Dict[str, Any] = {"model": "soak", "max_tokens": m, "ignore_eos": True,
                            "temperature": rng.choice([0, 0.7])}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng)}]
    else:
        body["prompt"] = prompt(rng)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def check_openai(body: Dict[str, Any], answer: Any) -> Optional[str]:
    usage = answer.get("usage") or {}
    if not answer.get("choices"):
        return "no choices"
    return _expect_tokens(usage.get("completion_tokens"), body["max_tokens"], "usage.completion_tokens")


def check_openai_stream(body: Dict[str, Any], events: List[Any]) -> Optional[str]:
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), {})
    finishes = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    if finishes != ["length"]:
        return f"finish reasons {finishes}, expected one 'length'"
    return _expect_tokens(usage.get("completion_tokens"), body["max_tokens"], "usage.completion_tokens")


# ---------------------------------------------------------------------- bodies meant to be refused
def bad_body(rng: random.Random, cfg: SoakConfig) -> Tuple[str, Any]:
    """(path, body): malformed JSON, wrong types, out-of-range values or an over-length prompt."""
    over = [1] * (cfg.context_len + rng.randint(0, 64))
    cases = [
        ("/generate", b'{"text": "unterminated'),
        ("/generate", {"text": "hi", "no_such_field": 1}),
        ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
        ("/generate", {"text": "hi", "sampling_params": {"top_p": 7}}),
        ("/generate", {"text": 17}),
        ("/generate", {"input_ids": over}),
        ("/v1/completions", {"model": "x", "prompt": "hi", "max_tokens": -3}),
        ("/v1/completions", {"model": "x", "prompt": over}),
        ("/v1/chat/completions", {"model": "x", "messages": "not a list"}),
        ("/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "hi"}], "n": 0}),
    ]
    return rng.choice(cases)


# ---------------------------------------------------------------------- one request
async def send(session: aiohttp.ClientSession, url: str, kind: str, path: str, body: Any,
               check: Optional[Callable[[Any], Optional[str]]], stream: bool, disconnect_at: Optional[int],
               deadline_s: float, refusal_names: str = "") -> Outcome:
    """Post `body` and classify the answer. `disconnect_at`: close after that many stream events
    (or, for a non-streaming request, after that many tenths of a second). `refusal_names`: text
    a refusal's message must hold (the flag that sets the limit)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        return await asyncio.wait_for(
            _send(session, url + path, kind, data, check, stream, disconnect_at, refusal_names), deadline_s)
    except asyncio.TimeoutError:
        return Outcome(kind, "failed", 0, f"no answer within {deadline_s:.0f} s")
    except (aiohttp.ClientError, ValueError) as exc:
        return Outcome(kind, "failed", 0, f"{type(exc).__name__}: {exc}")


async def _send(session: aiohttp.ClientSession, url: str, kind: str, data: bytes,
                check: Optional[Callable[[Any], Optional[str]]], stream: bool,
                disconnect_at: Optional[int], refusal_names: str = "") -> Outcome:
    headers = {"Content-Type": "application/json"}
    if disconnect_at is not None and not stream:
        task = asyncio.ensure_future(session.post(url, data=data, headers=headers))
        await asyncio.sleep(disconnect_at / 10)
        if not task.done():
            task.cancel()
            return Outcome(kind, "disconnected")
        async with await task as resp:  # answered before the client left: judge it like any other
            if resp.status != 200:
                return await _classify_error(kind, resp, expected_refusal=check is None)
        return Outcome(kind, "disconnected", resp.status)
    async with session.post(url, data=data, headers=headers) as resp:
        if resp.status != 200:
            return await _classify_error(kind, resp, expected_refusal=check is None, names=refusal_names)
        if check is None:
            return Outcome(kind, "failed", 200, "a body meant to be refused was accepted")
        if stream:
            events, done = await _read_sse(resp, disconnect_at)
            if disconnect_at is not None and not done:
                return Outcome(kind, "disconnected", 200)
            if not done:
                return Outcome(kind, "failed", 200, "stream ended without [DONE]")
            problem = check(events)
        else:
            problem = check(await resp.json())
    return Outcome(kind, "failed" if problem else "ok", 200, problem or "")


async def _classify_error(kind: str, resp: aiohttp.ClientResponse, expected_refusal: bool,
                          names: str = "") -> Outcome:
    text = await resp.text()
    try:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return Outcome(kind, "failed", resp.status, f"not a JSON error body: {text[:120]!r}")
    if resp.status == 503 and resp.headers.get("Retry-After") and error.get("code") != "server_error":
        if "queue" in error["message"].lower():
            return Outcome(kind, "shed", 503)
    if 400 <= resp.status < 500 and expected_refusal:
        if names not in error["message"]:
            return Outcome(kind, "failed", resp.status, f"the refusal does not name {names}: {error['message'][:120]}")
        return Outcome(kind, "refused", resp.status)
    return Outcome(kind, "failed", resp.status, error["message"][:160])


def one_request(rng: random.Random, cfg: SoakConfig, url: str,
                session: aiohttp.ClientSession) -> Awaitable[Outcome]:
    """A request drawn from the mix (weights below), ready to await."""
    roll = rng.random()
    disconnect = rng.random() < cfg.disconnect_frac
    if roll < 0.10:
        path, body = bad_body(rng, cfg)
        return send(session, url, "bad", path, body, None, False, None, cfg.deadline_s)
    if roll < 0.10 + cfg.evil_frac / 2:
        path, body, flag = evil_refused(rng, prompt(rng))
        return send(session, url, "evil_refused", path, body, None, False, None, cfg.deadline_s, flag)
    if roll < 0.10 + cfg.evil_frac:
        kind, body, check = evil_served(rng, prompt(rng))
        return send(session, url, kind, "/generate", body, check, False, None, cfg.deadline_s)
    if roll < 0.50:
        variant = rng.choice(["single", "stream", "batch", "n", "logprobs"])
        body = native_body(rng, cfg, variant)
        stream = variant == "stream"
        if stream:
            def check(events: List[Any], body: Dict[str, Any] = body) -> Optional[str]:
                return check_native(body, events[-1]) if events else "no events"
        else:
            def check(answer: Any, body: Dict[str, Any] = body) -> Optional[str]:
                return check_native(body, answer)
        cut = (rng.randint(1, 4) if stream else rng.randint(0, 5)) if disconnect else None
        return send(session, url, f"native_{variant}", "/generate", body, check, stream, cut, cfg.deadline_s)
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    body = openai_body(rng, cfg, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if stream:
        def check(events: List[Any], body: Dict[str, Any] = body) -> Optional[str]:
            return check_openai_stream(body, events)
    else:
        def check(answer: Any, body: Dict[str, Any] = body) -> Optional[str]:
            return check_openai(body, answer)
    cut = (rng.randint(1, 4) if stream else rng.randint(0, 5)) if disconnect else None
    kind = ("chat" if chat else "completions") + ("_stream" if stream else "")
    return send(session, url, kind, path, body, check, stream, cut, cfg.deadline_s)
