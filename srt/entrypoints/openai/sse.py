"""Server-sent events for the OpenAI endpoints: `data: <json>\\n\\n` frames ending in `data: [DONE]`.

A stream is opened only after the first generate update arrived, so validation errors (raised on the
first iteration) become real 4xx responses; errors after that are sent as an `error` frame.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, Iterable, Optional

import orjson
from aiohttp import web

from managers.generate_input import RequestError
from srt.entrypoints.http_errors import error_body
from srt.entrypoints.http_server import StreamThrottle

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def frame(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def stream_sse(request: web.Request, updates: AsyncIterator[Any], first: Any,
                     to_chunks: Callable[[Any], Iterable[dict]],
                     closing: Optional[Callable[[], Iterable[dict]]] = None) -> web.StreamResponse:
    """Send `to_chunks(update)` for `first` and every later update that --stream-interval lets
    through (chunks are deltas of cumulative updates, so skipped ones lose nothing), then
    `closing()` and `[DONE]`. The generator is always closed: a client that disconnects aborts
    its request.
    """
    state = request.app["state"]
    throttle = StreamThrottle(getattr(state.server_args, "stream_interval", 1) or 1)
    response = web.StreamResponse(status=200, headers=SSE_HEADERS)
    try:
        await response.prepare(request)
        update = first
        while True:
            if update is first or throttle.should_send(update):
                payload = b"".join(frame(chunk) for chunk in to_chunks(update))
                if payload:
                    await response.write(payload)
            try:
                update = await updates.__anext__()
            except StopAsyncIteration:
                break
        if closing is not None:
            payload = b"".join(frame(chunk) for chunk in closing())
            if payload:
                await response.write(payload)
        await response.write(DONE)
    except RequestError as exc:  # refused after the stream opened: tell the client in-band
        await _write_error(response, exc)
    except ConnectionError as exc:
        logger.info("Client went away mid-stream (%s); aborting its request.", type(exc).__name__)
        return response
    finally:
        await updates.aclose()
    try:
        await response.write_eof()
    except ConnectionError:
        pass
    return response


async def _write_error(response: web.StreamResponse, exc: RequestError) -> None:
    try:
        await response.write(frame(error_body(exc.status_code, exc.message, exc.code, exc.param)) + DONE)
    except ConnectionError:
        pass
