"""Connection hygiene: the open-file limit is raised and the connection cap fits under it; a
connection that sends half a header is closed after --http-header-timeout; past --max-connections a
new connection reads a 503 with Retry-After while open ones keep working; a client that half-closes
after a complete request gets its response; a port taken during start-up is the last line logged;
thousands of half-open connections cost the other clients little."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import socket
import statistics
import time
import psutil
import pytest
import requests
from aiohttp import web

from server_utils import REPO_ROOT, free_port, running_server, start_server, wait_until_ready
from srt.entrypoints import connection_guard
from srt.entrypoints.connection_guard import (RESERVED_FDS, ConnectionGuard, connection_cap, raise_open_file_limit,
                                              refusal_response)
from tiny_models import load_script

evil = load_script(REPO_ROOT / "scripts" / "evil_connections.py")

HEADER_TIMEOUT_S = 2.0
CAP = 20
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}  # many seconds on CPU


# ---------------------------------------------------------------------- pure functions
class FakeLimits:
    """RLIMIT_NOFILE as the OS would keep it: setrlimit above `allow` is refused."""

    def __init__(self, soft: int, hard: int, allow: int = 1 << 62):
        self.soft, self.hard, self.allow, self.calls = soft, hard, allow, []

    def getrlimit(self, which: int):
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits) -> None:
        self.calls.append(limits)
        if limits[0] > self.allow:
            raise ValueError("not allowed")
        self.soft = limits[0]


@pytest.fixture
def limits(monkeypatch):
    def install(soft: int, hard: int, **kw) -> FakeLimits:
        fake = FakeLimits(soft, hard, **kw)
        monkeypatch.setattr(connection_guard.resource, "getrlimit", fake.getrlimit)
        monkeypatch.setattr(connection_guard.resource, "setrlimit", fake.setrlimit)
        return fake
    return install


def test_open_file_limit_is_raised_to_the_hard_limit(limits):
    fake = limits(1024, 65536)
    assert raise_open_file_limit() == (1024, 65536)
    assert fake.calls == [(65536, 65536)] and fake.soft == 65536


def test_open_file_limit_falls_back_when_the_os_refuses_the_hard_limit(limits):
    fake = limits(256, resource.RLIM_INFINITY, allow=connection_guard.NOFILE_FALLBACK)
    assert raise_open_file_limit() == (256, connection_guard.NOFILE_FALLBACK)
    assert fake.calls[0] == (connection_guard.NOFILE_CEILING, resource.RLIM_INFINITY)  # tried first


def test_open_file_limit_is_left_alone_at_the_hard_limit_or_when_refused(limits):
    fake = limits(4096, 4096)
    assert raise_open_file_limit() == (4096, 4096) and fake.calls == []
    fake = limits(512, 65536, allow=512)
    assert raise_open_file_limit() == (512, 512) and fake.soft == 512


def test_connection_cap_keeps_a_reserve_under_the_descriptor_limit():
    assert connection_cap(4096, 1 << 20) == 4096
    assert connection_cap(4096, 1024) == 1024 - RESERVED_FDS
    assert connection_cap(4096, 100) == 1  # never zero: the server must still answer someone
    assert connection_cap(4096, resource.RLIM_INFINITY) == 4096


def test_guard_logs_the_raise_and_the_lowered_cap(limits, caplog):
    limits(1024, 2048)

    class Args:
        max_connections, http_header_timeout = 4096, 10.0

    async def build() -> ConnectionGuard:
        return ConnectionGuard.for_server(Args)

    with caplog.at_level("INFO", logger="srt.entrypoints.connection_guard"):
        guard = asyncio.run(build())
    assert guard.max_connections == 2048 - RESERVED_FDS
    assert "raised 1024 -> 2048" in caplog.text
    assert f"--max-connections 4096 lowered to {2048 - RESERVED_FDS}" in caplog.text
    assert b"--max-connections=4096, lowered to" in guard.refusal


def test_refusal_is_a_complete_503_with_retry_after():
    raw = refusal_response(20, 20)
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    assert lines[0] == "HTTP/1.1 503 Service Unavailable"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Retry-After"] == "1" and headers["Connection"] == "close"
    assert int(headers["Content-Length"]) == len(body)
    assert "--max-connections=20" in json.loads(body)["error"]["message"]


# ---------------------------------------------------------------------- in process: a full close still aborts
def test_a_client_that_closes_its_socket_mid_request_still_cancels_the_handler():
    """A FIN reads the same for a half-close and a close; the closed one must still cancel the
    request (as before: the generation is aborted), the half-closed one gets its answer."""
    cancelled = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        try:
            await asyncio.sleep(3600 if request.query.get("forever") else 0.3)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.json_response({"ok": True})

    async def scenario():
        app = web.Application()
        app.router.add_post("/slow", slow)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = ConnectionGuard(10, 5.0).site(runner, "127.0.0.1", 0)
        await site.start()
        request = b"POST /slow%s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(request % b"?forever=1")
            await asyncio.sleep(0.1)
            writer.close()  # gone, not half-closed
            await asyncio.wait_for(cancelled.wait(), 10)
            reader, writer = await asyncio.open_connection("127.0.0.1", site.port)
            writer.write(request % b"")
            writer.write_eof()
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer
        finally:
            await runner.cleanup()

    answer = asyncio.run(scenario())
    assert cancelled.is_set()
    assert b"HTTP/1.1 200 OK" in answer and answer.endswith(b'{"ok": true}')


# ---------------------------------------------------------------------- a real server with a small cap
@pytest.fixture(scope="module")
def small(llama_model):
    """--max-connections 20, --http-header-timeout 2, started with its soft open-file limit at 1024
    (the server raises it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    try:
        handle = start_server(llama_model, "--max-connections", str(CAP), "--http-header-timeout",
                              str(HEADER_TIMEOUT_S), "--http-keepalive-timeout", "30", wait_ready=False)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        wait_until_ready(handle)
        yield handle
    finally:
        handle.stop()


def test_the_server_raises_its_open_file_limit(small):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip("the hard open-file limit leaves nothing to raise")
    server_soft, _ = psutil.Process(small.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
    assert server_soft > 1024
    assert f"raised 1024 -> {server_soft}" in small.logs()


def test_half_open_connections_are_closed_after_the_header_timeout(small):
    start = time.monotonic()
    socks = evil.hold_half_open(small.url, 8) + evil.hold_half_open(small.url, 2, payload=b"")
    closed = evil.wait_closed(socks, HEADER_TIMEOUT_S + 10, start=start)
    assert all(c is not None for c in closed), closed
    assert min(closed) >= HEADER_TIMEOUT_S * 0.5, closed  # the deadline closed them, not the parser
    assert max(closed) <= HEADER_TIMEOUT_S + 10
    assert "(--http-header-timeout)" in small.logs()
    assert small.get("/health").status_code == 200


def _health(conn: http.client.HTTPConnection):
    conn.request("GET", "/health")
    resp = conn.getresponse()
    return resp.status, dict(resp.getheaders()), resp.read()


def test_connections_past_the_cap_get_503_and_service_resumes(small):
    host, port = "127.0.0.1", small.port
    first = http.client.HTTPConnection(host, port, timeout=10)
    assert _health(first)[0] == 200  # a keep-alive client from before the flood
    kept, refused = [], []
    try:
        for _ in range(CAP + 10):
            conn = http.client.HTTPConnection(host, port, timeout=10)
            status, headers, body = _health(conn)
            if status == 200:
                kept.append(conn)  # stays open: keep-alive for 30 s
            else:
                refused.append((status, headers, body))
                conn.close()
        assert 1 + len(kept) <= CAP and len(refused) >= 10
        for status, headers, body in refused:
            assert status == 503 and headers["Retry-After"] == "1" and headers["Connection"] == "close"
            assert f"--max-connections={CAP}" in json.loads(body)["error"]["message"]
        assert _health(first)[0] == 200  # open connections keep working at the cap
    finally:
        for conn in kept:
            conn.close()
    deadline = time.monotonic() + 10
    while True:
        status = _health(http.client.HTTPConnection(host, port, timeout=10))[0]
        if status == 200:
            break
        assert time.monotonic() < deadline, "new clients were not served after the idle ones closed"
        time.sleep(0.1)
    assert small.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert "(--max-connections)" in small.logs()
    first.close()


def test_a_half_closed_client_gets_its_complete_response(small):
    body = json.dumps({"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).encode()
    status, headers, payload = evil.half_closed_request(small.url, "/generate", body)
    assert status == 200, (headers, payload)
    fields = dict(line.split(b": ", 1) for line in headers.split(b"\r\n")[1:])
    length = int(fields[b"Content-Length"])
    assert len(payload) == length
    assert json.loads(payload)["meta_info"]["completion_tokens"] == 4


def test_a_client_that_closes_mid_request_aborts_it(small):
    aborts = small.get("/get_server_info").json()["load"]["counters"]["num_aborts"]
    body = json.dumps({"text": "Go away", "sampling_params": LONG}).encode()
    sock = socket.create_connection(("127.0.0.1", small.port))
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 20
    while small.get("/get_server_info").json()["num_front_end_requests"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sock.close()
    while small.get("/get_server_info").json()["num_front_end_requests"]:
        assert time.monotonic() < deadline, "the request of a closed client kept running"
        time.sleep(0.05)
    assert small.get("/get_server_info").json()["load"]["counters"]["num_aborts"] == aborts + 1


# ---------------------------------------------------------------------- the port
def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_a_second_server_on_a_taken_port_exits_with_the_cause_last(small, llama_model):
    second = start_server(llama_model, "--port", str(small.port), wait_ready=False)
    assert second.proc.wait(60) != 0
    last = _last_line(second.logs())
    assert f"127.0.0.1:{small.port}" in last and "already in use" in last, second.logs()[-2000:]
    assert small.get("/health").status_code == 200


def test_a_port_taken_during_start_up_is_the_last_line(llama_model):
    port = free_port()
    server = start_server(llama_model, "--port", str(port), wait_ready=False)
    try:
        parent = psutil.Process(server.proc.pid)
        deadline = time.monotonic() + 60
        while not parent.children():  # past the early port check: the children are starting
            assert server.proc.poll() is None and time.monotonic() < deadline, server.logs()
            time.sleep(0.02)
        with socket.socket() as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            assert server.proc.wait(120) == 1
    finally:
        server.stop(5)
    last = _last_line(server.logs())
    assert f"127.0.0.1:{port}" in last and "in use" in last, server.logs()[-2000:]


# ---------------------------------------------------------------------- under load
LOAD_HALF_OPEN = 2000
LOAD_HEADER_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def loaded(llama_model):
    with running_server(llama_model, "--http-header-timeout", str(LOAD_HEADER_TIMEOUT_S)) as handle:
        yield handle


def test_thousands_of_half_open_connections_cost_others_little_and_are_closed(loaded):
    evil.raise_own_nofile(LOAD_HALF_OPEN + 512)
    pid, session = loaded.proc.pid, requests.Session()
    evil.p50_generate_ms(loaded.url, 5, session)  # warm
    idle_fds = evil.server_fds(pid)
    before = evil.p50_generate_ms(loaded.url, 30, session)
    start = time.monotonic()
    socks = evil.hold_half_open(loaded.url, LOAD_HALF_OPEN)
    try:
        during = evil.p50_generate_ms(loaded.url, 30, session)
        measured_by = time.monotonic() - start
        held_fds = evil.server_fds(pid)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    closed = evil.wait_closed(socks, LOAD_HEADER_TIMEOUT_S + 30, start=start)
    after = evil.p50_generate_ms(loaded.url, 30, session)
    assert measured_by < LOAD_HEADER_TIMEOUT_S, "the measurement ran into the header timeout"
    # Other processes on a shared machine shift every phase; the slower of the two phases without
    # half-open connections is the baseline.
    assert during < 3 * max(before, after), (before, during, after)
    assert LOAD_HALF_OPEN <= held_fds - idle_fds < LOAD_HALF_OPEN + 200, (idle_fds, held_fds)
    assert all(c is not None for c in closed), f"{sum(c is None for c in closed)} still open"
    assert statistics.median(closed) >= LOAD_HEADER_TIMEOUT_S * 0.5
    deadline = time.monotonic() + 10
    while evil.server_fds(pid) > idle_fds + 50:
        assert time.monotonic() < deadline, (idle_fds, evil.server_fds(pid))
        time.sleep(0.1)
