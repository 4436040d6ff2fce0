"""The aiohttp application: middlewares (errors, auth, body cap, request log) and the native routes.

Every route handler reads the `ServerState` at `app["state"]`. Client mistakes always get a JSON
error (`http_errors.json_error`) with a 4xx status, never a 500; streaming responses validate
before the first byte. The OpenAI layer and /metrics register their own routes on the same app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
import warnings
from importlib import metadata
from typing import Any, AsyncIterator, Dict, Optional

import orjson
from aiohttp import web

from managers.generate_input import GenerateReqInput, RequestError
from srt.entrypoints.http_errors import json_error
from srt.entrypoints.json_body import parse_json_body
from srt.entrypoints.server_state import ServerState

logger = logging.getLogger(__name__)

STATE_KEY = "state"  # app[STATE_KEY] -> ServerState (a str key: other modules read app["state"])
PUBLIC_PATHS = frozenset({"/health"})  # reachable without --api-key
HEALTH_TIMEOUT_S = 20.0
HEALTH_POLL_S = 0.25  # /health_generate re-checks the scheduler's heartbeat this often while it waits
LOAD_TIMEOUT_S = 5.0
RETRY_AFTER_S = 1  # the Retry-After of every 503 (queue full, shutting down, scheduler not answering)
LOG_PREVIEW_CHARS = 2000


def version() -> str:
    try:
        return metadata.version("radix-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------- request helpers
async def read_json_body(request: web.Request) -> Any:
    """The parsed JSON body; `RequestError` 400 (empty, not UTF-8, not JSON, too deep or too many
    values: srt/entrypoints/json_body.py) or 413 (too large)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request) from None
    state = request.app[STATE_KEY]
    body = await parse_json_body(raw, getattr(state.server_args, "max_request_json_items", None))
    request["json_body"] = body  # for --log-requests
    return body


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


SHUTTING_DOWN = "The server is shutting down: it accepts no new requests (in-flight requests are finishing)."


def check_serving(state: ServerState) -> None:
    """503 when the runtime cannot take requests: a child died, shutting down, or the scheduler
    has not answered for a few seconds (new requests would only wait behind it)."""
    if state.dead_reason:
        raise RequestError(state.dead_reason, 503, code="service_unavailable")
    if state.shutting_down:
        raise RequestError(SHUTTING_DOWN, 503, code="service_unavailable")
    silent = state.silent_scheduler()
    if silent:
        raise RequestError(f"{silent} New requests are refused until it answers again.", 503,
                           code="service_unavailable")


def _too_large(request: web.Request) -> RequestError:
    cap = _body_cap(request.app[STATE_KEY])
    size = f"{request.content_length} bytes" if request.content_length is not None else "the body"
    return RequestError(f"Request body too large: {size} exceeds the limit of {cap} bytes "
                        f"(--max-request-body-mb).", 413, code="request_too_large")


def _body_cap(state: ServerState) -> int:
    return int(float(getattr(state.server_args, "max_request_body_mb", 32)) * 2**20)


class StreamThrottle:
    """--stream-interval: pass an update when its output grew by `interval` tokens since the last
    one passed for the same index, or when it is final."""

    def __init__(self, interval: int):
        self.interval = max(int(interval), 1)
        self._sent: Dict[int, int] = {}

    def should_send(self, out: Dict[str, Any]) -> bool:
        meta = out.get("meta_info", {})
        if self.interval == 1 or meta.get("finish_reason") is not None:
            return True
        index = out.get("index", 0)
        tokens = int(meta.get("completion_tokens", len(out.get("output_ids", []))))
        if tokens - self._sent.get(index, 0) >= self.interval:
            self._sent[index] = tokens
            return True
        return False


def sse_event(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


# ---------------------------------------------------------------------- middlewares
@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Client mistakes -> their status in the JSON error shape; server faults -> logged 500."""
    try:
        return await handler(request)
    except RequestError as exc:
        return json_error(exc.status_code, exc.message, exc.code, exc.param)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_exception_json(request, exc)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        logger.exception("Unhandled error in %s %s", request.method, request.path)
        return json_error(500, f"Internal server error: {type(exc).__name__}: {exc}", code="internal_error")


def _http_exception_json(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status == 404:
        message = f"Not found: {request.method} {request.path} is not a route of this server."
    elif exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"Method {request.method} is not allowed for {request.path}; use {allowed or 'another method'}."
    elif exc.status == 413:
        return json_error(413, _too_large(request).message, code="request_too_large")
    else:
        message = exc.text or exc.reason
    resp = json_error(exc.status, message)
    if "Allow" in exc.headers:
        resp.headers["Allow"] = exc.headers["Allow"]
    return resp


@web.middleware
async def retry_after_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every 503 (from any route, the OpenAI layer's included) says when to retry."""
    resp = await handler(request)
    if resp.status == 503 and not resp.prepared and "Retry-After" not in resp.headers:
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    """--api-key: `Authorization: Bearer <key>` or `x-api-key: <key>`, compared in constant time."""
    api_key = getattr(request.app[STATE_KEY].server_args, "api_key", None)
    if not api_key or request.path in PUBLIC_PATHS:
        return await handler(request)
    given = request.headers.get("x-api-key")
    auth = request.headers.get("Authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
        what = "Missing" if given is None else "Invalid"
        return json_error(401, f"{what} API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>' "
                               f"with the server's --api-key.", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def body_cap_middleware(request: web.Request, handler) -> web.StreamResponse:
    """413 before reading a body whose declared size is over --max-request-body-mb (chunked bodies
    are capped by the app's client_max_size while reading)."""
    length = request.content_length
    if length is not None and length > _body_cap(request.app[STATE_KEY]):
        raise _too_large(request)
    return await handler(request)


@web.middleware
async def log_middleware(request: web.Request, handler) -> web.StreamResponse:
    """--log-requests: one line per request with status, latency and body previews."""
    if not getattr(request.app[STATE_KEY].server_args, "log_requests", False):
        return await handler(request)
    start = time.perf_counter()
    resp = await handler(request)
    body = request.get("json_body")
    preview = "" if body is None else " request=" + orjson.dumps(body).decode()[:LOG_PREVIEW_CHARS]
    if isinstance(resp, web.Response) and resp.body is not None and resp.content_type == "application/json":
        preview += " response=" + bytes(resp.body)[:LOG_PREVIEW_CHARS].decode("utf-8", "replace")
    logger.info("%s %s %d %.3fs%s", request.method, request.path, resp.status, time.perf_counter() - start, preview)
    return resp


# ---------------------------------------------------------------------- /generate
async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's native generate: single or batch, text or input_ids, optional SSE streaming."""
    state: ServerState = request.app[STATE_KEY]
    body = await read_json_body(request)
    obj = GenerateReqInput.from_dict(body)
    check_serving(state)
    outputs = state.tokenizer_manager.generate_request(obj)
    try:
        first = await outputs.__anext__()  # validation and scheduler refusals raise here: a real 4xx
        if not obj.stream:
            return json_response(first)
        return await _stream_sse(request, outputs, first, state.server_args.stream_interval)
    finally:
        await outputs.aclose()  # a request whose consumer is gone is aborted here


async def _stream_sse(request: web.Request, outputs: AsyncIterator[Any], first: Any,
                      interval: int) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    throttle = StreamThrottle(interval)
    try:
        if throttle.should_send(first):
            await resp.write(sse_event(first))
        try:
            async for out in outputs:
                if throttle.should_send(out):
                    await resp.write(sse_event(out))
        except RequestError as exc:  # after the first byte: report in-band, then end the stream
            await resp.write(sse_event({"error": {"message": exc.message, "code": exc.code,
                                                  "status_code": exc.status_code}}))
        await resp.write(SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        logger.info("Client disconnected from stream %s; aborting its request.", request.path)
    return resp


# ---------------------------------------------------------------------- admin routes
async def health(request: web.Request) -> web.Response:
    """Liveness (GET or HEAD): the HTTP process answers. 503 only once a runtime child has died or
    while shutting down (so routers stop sending); a slow or stopped scheduler is readiness's concern."""
    state: ServerState = request.app[STATE_KEY]
    if state.dead_reason:
        return json_error(503, state.dead_reason, code="service_unavailable")
    if state.shutting_down:
        return json_error(503, SHUTTING_DOWN, code="service_unavailable")
    return json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """SGLang's readiness probe: 200 once the warm-up request succeeded and while the scheduler
    answers (heartbeat and current step within $SRT_SCHEDULER_STALE_S), else 503 with the reason."""
    state: ServerState = request.app[STATE_KEY]
    reason = state.dead_reason or (SHUTTING_DOWN if state.shutting_down else None)
    reason = reason or (None if state.ready else "The server is not ready (warm-up not finished).")
    reason = reason or state.unready_scheduler()
    if reason is None:
        return json_response({"status": "ready"})
    return json_error(503, reason, code="service_unavailable")


async def health_generate(request: web.Request) -> web.Response:
    """Readiness: a real one-token generation through the scheduler. Fails fast (503) when the
    scheduler has not answered for $SRT_SCHEDULER_STALE_S seconds, before or while it waits."""
    state: ServerState = request.app[STATE_KEY]
    check_serving(state)
    if not state.ready:
        return json_error(503, "The server is starting (warm-up not finished).", code="service_unavailable")
    procs = state.processes
    if procs is not None and not procs.alive():
        return json_error(503, "A runtime process is not alive.", code="service_unavailable")
    stuck = state.unready_scheduler()
    if stuck:
        return json_error(503, stuck, code="service_unavailable")
    obj = GenerateReqInput(input_ids=[0], rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
                           sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        result = await _final_while_answering(state, obj, HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return json_error(503, f"The health-check generation did not finish within {HEALTH_TIMEOUT_S:g} s.",
                          code="service_unavailable")
    except RequestError as exc:
        return json_error(503, f"The health-check generation failed: {exc.message}", code="service_unavailable")
    return json_response({"status": "ok", "completion_tokens": result["meta_info"].get("completion_tokens")})


async def _final(state: ServerState, obj: GenerateReqInput) -> Any:
    last = None
    async for out in state.tokenizer_manager.generate_request(obj):
        last = out
    return last


async def _final_while_answering(state: ServerState, obj: GenerateReqInput, timeout: float) -> Any:
    """`_final`, given up (and aborted) after `timeout` or as soon as the scheduler stops answering."""
    loop = asyncio.get_running_loop()
    task = loop.create_task(_final(state, obj))
    deadline = loop.time() + timeout
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=min(HEALTH_POLL_S, max(deadline - loop.time(), 0)))
            if done:
                return task.result()
            reason = state.unready_scheduler()
            if reason:
                raise RequestError(reason, 503, code="service_unavailable")
            if loop.time() >= deadline:
                raise asyncio.TimeoutError
    finally:
        if not task.done():
            task.cancel()


async def get_model_info(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE_KEY]
    args, info = state.server_args, state.scheduler_info
    return json_response({
        "model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
        "served_model_name": state.model_name, "is_generation": True,
        "context_length": info.context_len, "max_model_len": state.max_model_len, "vocab_size": info.vocab_size,
    })


def server_args_dict(args: Any) -> Dict[str, Any]:
    out = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
    if out.get("api_key"):
        out["api_key"] = "<redacted>"
    return out


async def get_server_info(request: web.Request) -> web.Response:
    """Server args, the runtime limits (T, max_req_input_len, ...), version and the current load."""
    state: ServerState = request.app[STATE_KEY]
    info = state.scheduler_info
    tm = state.tokenizer_manager
    body = server_args_dict(state.server_args)
    body.update(
        max_total_num_tokens=info.max_total_num_tokens, max_req_input_len=info.max_req_input_len,
        max_req_len=info.max_req_len, max_running_requests=info.max_running_requests,
        context_length=info.context_len, max_model_len=state.max_model_len, vocab_size=info.vocab_size,
        kv_budget=info.kv_budget, served_model_name=state.model_name, version=version(), ready=state.ready,
        shutting_down=state.shutting_down, chunked_prefill_size=_effective_chunk(state),
        uptime_s=time.time() - state.started_time, num_front_end_requests=len(tm.rid_to_state),
        pids=state.processes.pids() if state.processes is not None else {}, load=await _load(state))
    return json_response(body)


def _effective_chunk(state: ServerState) -> Optional[int]:
    """--chunked-prefill-size as the scheduler applies it (its default depends on the device)."""
    from srt.server_args import effective_chunked_prefill_size

    device = (state.scheduler_info.kv_budget or {}).get("device_kind") or state.server_args.device
    return effective_chunked_prefill_size(state.server_args.chunked_prefill_size, device)


async def _load(state: ServerState) -> Optional[Dict[str, Any]]:
    if state.dead_reason or state.shutting_down:
        return None
    try:
        load = await asyncio.wait_for(state.tokenizer_manager.get_load(), LOAD_TIMEOUT_S)
    except (asyncio.TimeoutError, RequestError):
        return None
    return dataclasses.asdict(load)


async def get_load(request: web.Request) -> web.Response:
    """SGLang's legacy load report that sglang-router polls: one entry per data-parallel rank."""
    state: ServerState = request.app[STATE_KEY]
    check_serving(state)
    try:
        load = await asyncio.wait_for(state.tokenizer_manager.get_load(), LOAD_TIMEOUT_S)
    except asyncio.TimeoutError:
        return json_error(503, f"The scheduler did not report its load within {LOAD_TIMEOUT_S:g} s.",
                          code="service_unavailable")
    ranks = getattr(load, "replicas", None) or [dataclasses.asdict(load)]  # per replica once merged
    return json_response([{
        "dp_rank": r.get("dp_rank", i), "num_reqs": r.get("num_running_reqs", 0) + r.get("num_waiting_reqs", 0),
        "num_waiting_reqs": r.get("num_waiting_reqs", 0),
        "num_tokens": round(r.get("token_usage", 0.0) * r.get("max_total_num_tokens", 0)),
    } for i, r in enumerate(ranks)])


async def flush_cache(request: web.Request) -> web.Response:
    """200 when flushed; 400 with the scheduler's reason (requests in flight) when not."""
    state: ServerState = request.app[STATE_KEY]
    check_serving(state)
    out = await state.tokenizer_manager.flush_cache()
    if not out.success:
        return json_error(400, out.message or "Cache not flushed.", code="cache_not_flushed")
    return json_response({"success": True, "message": out.message or "Cache flushed."})


async def abort_request(request: web.Request) -> web.Response:
    """`{"rid": prefix}` aborts every request whose rid starts with it; `{"abort_all": true}` all."""
    state: ServerState = request.app[STATE_KEY]
    body = await read_json_body(request)
    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, got {type(body).__name__}.", 400)
    for key in body:
        if key not in ("rid", "abort_all"):
            raise RequestError(f"Unknown field '{key}'. Supported fields: abort_all, rid.", 400, param=key)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise RequestError(f"abort_all must be a boolean, got {abort_all!r}.", 400, param="abort_all")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise RequestError(f"rid must be a non-empty string (a request id prefix), got {rid!r}.", 400, param="rid")
    if rid is None and not abort_all:
        raise RequestError("Send 'rid' (a request id prefix) or 'abort_all': true.", 400)
    check_serving(state)
    await state.tokenizer_manager.abort_request(rid=rid or "", abort_all=abort_all)
    return json_response({"success": True})


# ---------------------------------------------------------------------- the app
def create_app(state: ServerState) -> web.Application:
    """The application with every route; `state` is stored at `app["state"]`."""
    app = web.Application(
        middlewares=[log_middleware, retry_after_middleware, error_middleware, auth_middleware, body_cap_middleware],
        client_max_size=_body_cap(state))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", getattr(web, "NotAppKeyWarning", Warning))
        app[STATE_KEY] = state
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)  # HEAD too (load balancers probe with it)
    app.router.add_route("POST", "/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/ready", ready)
    for prefix in ("/get_", "/"):  # SGLang serves both spellings; routers probe either
        app.router.add_get(f"{prefix}model_info", get_model_info)
        app.router.add_get(f"{prefix}server_info", get_server_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_route("GET", "/flush_cache", flush_cache)  # SGLang's RuntimeEndpoint uses GET
    app.router.add_post("/abort_request", abort_request)
    _register_optional(app, "srt.entrypoints.openai", "register_openai_routes")
    _register_optional(app, "srt.entrypoints.metrics", "register_metrics_routes")
    return app


def _register_optional(app: web.Application, module: str, func: str) -> None:
    """Routes of a layer that may be absent from this build; any other import error is raised."""
    import importlib

    try:
        register = getattr(importlib.import_module(module), func, None)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise
        register = None
    if register is None:
        logger.warning("%s.%s is not available: its routes are not served.", module, func)
        return
    register(app)
