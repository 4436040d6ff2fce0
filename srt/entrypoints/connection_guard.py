"""Connection hygiene of the HTTP server: the open-file limit, a cap on open connections (a 503
written at the transport past it), a deadline for a request's headers, and replies to clients that
half-close their socket after a complete request.

`ConnectionGuard` wraps the protocol factory of aiohttp's low-level `web.Server` (each connection's
`RequestHandler` sits inside a `GuardedConnection`) and its public `request_factory` (which tells
when a connection's request headers are complete); `GuardedSite` listens with that factory.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from typing import Any, Callable, Dict, Optional, Tuple

import orjson
from aiohttp import web
from yarl import URL

from srt.entrypoints.http_errors import error_body

try:
    import resource
except ImportError:  # not a POSIX system: the limit is the OS's to set
    resource = None

logger = logging.getLogger(__name__)

# Descriptors kept out of the connection cap for the server's own files and sockets (zmq sockets and
# pipes to the children, the listening socket, log and model files: about 30 on an idle CPU server),
# the refused connections that linger for a moment (at most MAX_LINGERING_REFUSALS), and headroom.
RESERVED_FDS = 256
MAX_LINGERING_REFUSALS = 64
REFUSAL_LINGER_S = 1.0  # a refused client gets this long to read the 503 before the socket closes
NOFILE_CEILING = 1 << 20  # Linux's default fs.nr_open: the target when the hard limit is unlimited
NOFILE_FALLBACK = 10240  # macOS's OPEN_MAX, tried when the OS refuses the hard limit itself
LISTEN_BACKLOG = 1024  # a burst of connects waits in the kernel instead of being dropped
# After a client half-closes with its request's response not yet started, this 1xx makes a peer
# that really closed its socket answer with a reset; the checks then see it and abort the request.
PEER_PROBE = b"HTTP/1.1 100 Continue\r\n\r\n"
PEER_CHECKS_S = (0.05, 0.2, 1.0, 3.0)
SUMMARY_EVERY_S = 60.0  # refused / timed-out connections are logged as one line per period

_ABSENT = object()


def raise_open_file_limit() -> Tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit where the OS allows; returns the (old, new)
    soft limits, equal when nothing changed (-1 for unlimited or unknown)."""
    if resource is None:
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    target = NOFILE_CEILING if hard == infinity else hard
    if soft == infinity or soft >= target:
        return soft, soft
    for candidate in (target, min(target, NOFILE_FALLBACK)):
        if candidate <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
        except (ValueError, OSError):
            continue
        return soft, candidate
    return soft, soft


def connection_cap(requested: int, nofile_soft: int, reserve: int = RESERVED_FDS) -> int:
    """The open connections the server accepts: `requested` (--max-connections), lowered so that
    they and `reserve` descriptors fit the soft open-file limit; at least 1."""
    if nofile_soft < 0 or (resource is not None and nofile_soft == resource.RLIM_INFINITY):
        return requested
    return max(1, min(requested, nofile_soft - reserve))


def refusal_response(cap: int, requested: int) -> bytes:
    """The whole HTTP answer to a connection past the cap: 503, Retry-After, Connection: close."""
    lowered = f", lowered to {cap} to fit the open-file limit" if cap < requested else ""
    message = (f"The server holds its limit of {cap} open connections (--max-connections={requested}{lowered}); "
               f"retry in a second.")
    body = orjson.dumps(error_body(503, message, code="too_many_connections"))
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + body


def _handler_idle(handler: web.RequestHandler) -> bool:
    """True when the handler waits for a request (nothing received that needs an answer).

    aiohttp 3.9-3.14 keeps that wait in `_waiter` (a pending future) and tests it the same way in
    its own keep-alive check; without that attribute the connection counts as idle (aiohttp's own
    behaviour on a half-close: the connection closes)."""
    waiter = getattr(handler, "_waiter", _ABSENT)
    if waiter is _ABSENT:
        return True
    return waiter is not None and not waiter.done()


class _Summary:
    """Counts an event; logs the first at once and the rest as one line per SUMMARY_EVERY_S."""

    def __init__(self, loop: asyncio.AbstractEventLoop, level: int, text: str):
        self._loop, self._level, self._text = loop, level, text
        self._count = 0
        self._flush: Optional[asyncio.TimerHandle] = None

    def add(self) -> None:
        self._count += 1
        if self._flush is None:
            self._period_over()

    def _period_over(self) -> None:
        self._flush = None
        if self._count:
            logger.log(self._level, self._text, self._count)
            self._count = 0
            self._flush = self._loop.call_later(SUMMARY_EVERY_S, self._period_over)

    def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None


class ConnectionGuard:
    """Caps open connections at `max_connections` and closes a connection whose first request's
    headers are not complete `header_timeout` seconds after it connected.

    Later requests on a keep-alive connection are aiohttp's: its keep-alive timer closes a
    connection that has not delivered the next request's headers `keepalive_timeout` seconds after
    the previous response."""

    def __init__(self, max_connections: int, header_timeout: float, requested: Optional[int] = None,
                 loop: Optional[asyncio.AbstractEventLoop] = None):
        self.loop = loop or asyncio.get_running_loop()
        self.max_connections, self.header_timeout = max_connections, header_timeout
        self.refusal = refusal_response(max_connections, requested or max_connections)
        self._open: Dict[web.RequestHandler, GuardedConnection] = {}
        self._lingering: set = set()
        self._server: Optional[web.Server] = None
        self._make_request: Optional[Callable[..., Any]] = None
        self._refused = _Summary(self.loop, logging.WARNING, "Refused %d connection(s) with 503: "
                                 f"{max_connections} were open (--max-connections).")
        self._slow = _Summary(self.loop, logging.INFO, "Closed %d connection(s) that sent no complete request "
                              f"headers within {header_timeout:g} s (--http-header-timeout).")

    @classmethod
    def for_server(cls, server_args: Any) -> "ConnectionGuard":
        """Raise the open-file limit, fit --max-connections under it (logging both), build the guard."""
        old, new = raise_open_file_limit()
        if new != old:
            logger.info("Open-file limit (RLIMIT_NOFILE soft) raised %d -> %d.", old, new)
        requested = server_args.max_connections
        cap = connection_cap(requested, new)
        if cap < requested:
            logger.warning("--max-connections %d lowered to %d: the open-file limit is %d and %d descriptors are "
                           "kept for the server's own files and sockets.", requested, cap, new, RESERVED_FDS)
        return cls(cap, server_args.http_header_timeout, requested)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def site(self, runner: web.BaseRunner, host: str, port: int) -> "GuardedSite":
        """A site listening on `host:port` through this guard; call after `runner.setup()`."""
        server = runner.server
        assert server is not None, "call runner.setup() first"
        # Each RequestHandler copies Server.request_factory when it is built, so this comes first.
        self._server, self._make_request = server, server.request_factory
        server.request_factory = self._request_started
        return GuardedSite(runner, host, port, self._new_connection)

    def close(self) -> None:
        """Close the refused connections still lingering (the rest are the runner's to close)."""
        self._refused.close()
        self._slow.close()
        for transport in list(self._lingering):
            transport.abort()

    def _new_connection(self) -> asyncio.Protocol:
        if len(self._open) >= self.max_connections:
            self._refused.add()
            return _Refusal(self)
        handler = self._server()
        conn = GuardedConnection(self, handler)
        self._open[handler] = conn
        return conn

    def _request_started(self, message: Any, payload: Any, protocol: Any, writer: Any, *rest: Any) -> Any:
        conn = self._open.get(protocol)
        if conn is not None:
            conn.request_started(payload, writer, getattr(message, "version", None))
        return self._make_request(message, payload, protocol, writer, *rest)

    def _forget(self, handler: web.RequestHandler) -> None:
        self._open.pop(handler, None)


class GuardedConnection(asyncio.Protocol):
    """One accepted connection: aiohttp's `RequestHandler` inside, plus the header deadline and
    the half-close handling."""

    def __init__(self, guard: ConnectionGuard, handler: web.RequestHandler):
        self._guard, self._handler = guard, handler
        self._transport: Optional[asyncio.Transport] = None
        self._header_timer: Optional[asyncio.TimerHandle] = None
        self._peer_check: Optional[asyncio.TimerHandle] = None
        self._payload: Any = None
        self._writer: Any = None
        self._http11 = False  # only HTTP/1.1 clients may be sent an unrequested 1xx (RFC 9110 15.2)
        self._eof = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._handler.connection_made(transport)
        # aiohttp 3.14.5 also starts its keep-alive timer here (3.9-3.14.3 do not); until the first
        # request's headers are in, the header deadline rules instead (keep_alive(True) cancels it).
        self._handler.keep_alive(True)
        self._header_timer = self._guard.loop.call_later(self._guard.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> Optional[bool]:
        """The client shut its sending side. aiohttp's RequestHandler (3.9-3.14) returns None here,
        so the transport closes and, with handler_cancellation, a complete request is cancelled
        unanswered. Instead: answer what was received, then close; close at once when nothing
        complete was received."""
        if self._eof:
            return True
        if self._handler.eof_received():
            return True
        if _handler_idle(self._handler) or self._body_incomplete():
            return None
        self._eof = True
        self._handler.close()  # no further keep-alive requests: the response, then the close
        if self._writer is not None and not self._writer.output_size and self._http11:
            self._probe_peer()
        return True

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        for timer in (self._header_timer, self._peer_check):
            if timer is not None:
                timer.cancel()
        self._header_timer = self._peer_check = None
        self._guard._forget(self._handler)
        self._handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def request_started(self, payload: Any, writer: Any, version: Any = None) -> None:
        """aiohttp built a request from complete headers (or an error answer for bad ones)."""
        self._http11 = version is not None and tuple(version) >= (1, 1)
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._payload, self._writer = payload, writer
        if self._eof and self._body_incomplete():
            self._guard.loop.call_soon(self._handler.force_close)

    def _body_incomplete(self) -> bool:
        return self._payload is not None and not self._payload.is_eof()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        self._guard._slow.add()
        self._handler.force_close()

    def _probe_peer(self, step: int = 0) -> None:
        """A FIN reads the same whether the client only shut its sending side or closed its socket
        (gone: its request should be aborted, as on a reset). Write an interim 1xx, which HTTP/1.1
        clients skip; a closed socket answers it with a reset, seen here as a socket error."""
        self._peer_check = None
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if step == 0:
            transport.write(PEER_PROBE)
        else:
            sock = transport.get_extra_info("socket")
            try:
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock is not None else 0
            except OSError as exc:
                error = exc.errno or errno.EBADF
            if error:
                self._handler.force_close()  # connection_lost cancels the handler, as for a reset
                return
        if step < len(PEER_CHECKS_S):
            self._peer_check = self._guard.loop.call_later(PEER_CHECKS_S[step], self._probe_peer, step + 1)


class _Refusal(asyncio.Protocol):
    """A connection past the cap: the 503 and our FIN at once, the client's bytes discarded, the
    socket closed when the client closes or after REFUSAL_LINGER_S (so the 503 is not lost to a
    reset for unread request bytes)."""

    def __init__(self, guard: ConnectionGuard):
        self._guard = guard
        self._transport: Optional[asyncio.Transport] = None
        self._timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        transport.write(self._guard.refusal)
        lingering = self._guard._lingering
        if len(lingering) >= MAX_LINGERING_REFUSALS or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        lingering.add(transport)
        self._timer = self._guard.loop.call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass  # the answer is the same whatever was asked

    def eof_received(self) -> None:
        return None  # the transport closes

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._guard._lingering.discard(self._transport)


class GuardedSite(web.BaseSite):
    """A TCP site like aiohttp's TCPSite, listening with the guard's protocol factory."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int,
                 protocol_factory: Callable[[], asyncio.Protocol], backlog: int = LISTEN_BACKLOG):
        super().__init__(runner, backlog=backlog)
        self._host, self._port, self._factory, self._listen_backlog = host, port, protocol_factory, backlog

    @property
    def port(self) -> int:
        """The bound port once started (useful with port 0), else the one asked for."""
        sockets = self._server.sockets if self._server is not None else None
        return sockets[0].getsockname()[1] if sockets else self._port

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self.port))

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._factory, self._host, self._port,
                                                backlog=self._listen_backlog, reuse_address=True)
