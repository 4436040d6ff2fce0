"""SIGTERM drains: new requests get 503 at once, in-flight ones may finish for
--graceful-shutdown-timeout seconds, the rest (or all of them on a second signal) fail with 503 and
the reason, on /generate and the OpenAI routes alike, never a 200 with partial text."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_utils import ServerHandle, sse_events, start_server
from srt.launch_server import _drain

LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}  # many seconds on CPU


def wait_in_flight(handle: ServerHandle, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while handle.get("/get_server_info").json()["num_front_end_requests"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests in flight"
        time.sleep(0.02)


def wait_draining(handle: ServerHandle, timeout: float = 10.0) -> None:
    """Until /health answers 503: the first SIGTERM has been taken and the server is draining."""
    deadline = time.monotonic() + timeout
    while handle.get("/health").status_code != 503:
        assert time.monotonic() < deadline, "the server did not start draining"
        time.sleep(0.01)


def stream_events(handle: ServerHandle, body: dict) -> list:
    resp = handle.post("/generate", json={**body, "stream": True}, stream=True)
    return [e for e in sse_events(resp)]


# ---------------------------------------------------------------------- in-process: the drain itself
class FakeTokenizerManager:
    def __init__(self, rids):
        self.rid_to_state = {rid: object() for rid in rids}
        self.failed, self.aborted_all = None, False

    def fail_all(self, reason: str) -> None:
        self.failed = reason
        self.rid_to_state.clear()

    async def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborted_all = abort_all


def test_drain_waits_for_in_flight_requests_to_finish():
    tm = FakeTokenizerManager(["a"])

    async def scenario() -> float:
        asyncio.get_running_loop().call_later(0.3, tm.rid_to_state.clear)  # the request finishes
        t0 = time.monotonic()
        await _drain(tm, 10.0, asyncio.Event())
        return time.monotonic() - t0

    took = asyncio.run(scenario())
    assert 0.25 < took < 2.0 and tm.failed is None and tm.aborted_all


def test_drain_fails_what_is_left_after_the_timeout_with_the_reason():
    tm = FakeTokenizerManager(["a", "b"])
    took = time.monotonic()
    asyncio.run(_drain(tm, 0.3, asyncio.Event()))
    took = time.monotonic() - took
    assert 0.25 < took < 2.0
    assert tm.failed.startswith("The server is shutting down: the request was aborted after waiting")
    assert "--graceful-shutdown-timeout=0.3" in tm.failed and tm.aborted_all


def test_drain_stops_waiting_at_a_second_signal():
    tm = FakeTokenizerManager(["a"])

    async def scenario() -> float:
        abort_now = asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, abort_now.set)
        t0 = time.monotonic()
        await _drain(tm, 30.0, abort_now)
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 2.0
    assert "without waiting" in tm.failed


# ---------------------------------------------------------------------- a real server
@pytest.fixture
def server(llama_model):
    handles = []

    def start(*args: str) -> ServerHandle:
        handles.append(start_server(llama_model, "--skip-server-warmup", *args))
        return handles[-1]

    yield start
    for handle in handles:
        handle.stop(5)


def test_requests_left_after_the_graceful_timeout_get_503_on_every_route(server):
    # 0.5 s: four 1,500-token requests decoded together finish about 1 s after they start on a
    # 2-core Zen 5 EPYC, so a 1 s drain sometimes let one of them complete.
    handle = server("--graceful-shutdown-timeout", "0.5")
    calls = {
        "generate": lambda: handle.post("/generate", json={"text": "Native", "sampling_params": LONG}),
        "completions": lambda: handle.post("/v1/completions", json={
            "model": "m", "prompt": "Completion", "max_tokens": 1500, "temperature": 0, "ignore_eos": True}),
        "chat": lambda: handle.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Chat"}], "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True}),
        "stream": lambda: stream_events(handle, {"text": "Stream", "sampling_params": LONG}),
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        wait_in_flight(handle, len(calls))
        t0 = time.monotonic()
        handle.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = handle.post("/generate", json={"text": "Late", "sampling_params": {"max_new_tokens": 2}})
        results = {name: f.result() for name, f in futures.items()}
        took = time.monotonic() - t0
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["message"].startswith("The server is shutting down: it accepts no new requests")
    for name in ("generate", "completions", "chat"):
        resp = results[name]
        assert resp.status_code == 503, (name, resp.status_code, resp.text[:300])
        error = resp.json()["error"]
        assert error["message"].startswith("The server is shutting down: the request was aborted after waiting")
        assert "--graceful-shutdown-timeout=0.5" in error["message"] and error["type"] == "service_unavailable"
    events = results["stream"]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["status_code"] == 503 and "shutting down" in last["error"]["message"]
    assert 0.4 < took < 15, took
    assert handle.proc.wait(20) == 0


def test_a_second_sigterm_aborts_in_flight_requests_at_once(server):
    handle = server()  # --graceful-shutdown-timeout 30 (the default)
    with ThreadPoolExecutor(1) as pool:
        # Nearly the whole 2,048-token context, and the drain detected by polling rather than a
        # fixed sleep: on a fast CPU a 1,500-token request finished within one second.
        longest = {**LONG, "max_new_tokens": 2000}
        future = pool.submit(handle.post, "/generate", json={"text": "Slow", "sampling_params": longest})
        wait_in_flight(handle, 1)
        handle.proc.send_signal(signal.SIGTERM)
        wait_draining(handle)
        assert not future.done()  # draining: the request is still running
        t0 = time.monotonic()
        handle.proc.send_signal(signal.SIGTERM)
        resp = future.result(timeout=10)
        took = time.monotonic() - t0
    assert resp.status_code == 503 and took < 5, (resp.status_code, took)
    assert "without waiting" in resp.json()["error"]["message"]
    assert handle.proc.wait(20) == 0



def test_two_concurrent_shutdowns_do_not_race(tmp_path):
    """The child watchdog (a child died) and the main thread (start-up failed) can shut down at
    the same moment; that raised 'dictionary changed size during iteration' in one of them."""
    import threading
    import time as _time
    from types import SimpleNamespace

    from srt.entrypoints.process_launcher import RuntimeProcesses

    class SlowProc:
        pid = 2**22 + 7  # no such process; is_alive() is False, so nothing is signalled

        def is_alive(self) -> bool:
            return False

        def join(self, timeout=None) -> None:
            _time.sleep(0.05)

    class Pipe:
        def close(self) -> None:
            pass

    procs = RuntimeProcesses.__new__(RuntimeProcesses)
    procs.port_args = SimpleNamespace(tmpdir=str(tmp_path / "ipc"))
    procs.procs = {f"p{i}": SlowProc() for i in range(6)}
    procs.pipes = {f"p{i}": Pipe() for i in range(6)}
    procs._stopping = False
    procs._shutdown_lock = threading.Lock()
    errors = []

    def stop() -> None:
        try:
            procs.shutdown(timeout=0.01)
        except Exception as exc:  # the race surfaced here
            errors.append(exc)

    threads = [threading.Thread(target=stop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == [] and procs.procs == {} and procs.pipes == {}
