"""Readiness follows the scheduler's heartbeat: /health is liveness (GET and HEAD), /ready and
/health_generate fail fast when the scheduler has not answered for a few seconds, new requests are
refused then, every 503 says when to retry, and a stuck step is reported with its stack."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from typing import Any, Optional

import pytest
import requests
from aiohttp.test_utils import TestClient, TestServer

from managers.generate_input import RequestError
from managers.io_struct import SchedulerReady
from managers.scheduler_process import SchedulerWatchdog
from server_utils import running_server
from srt.entrypoints.http_server import create_app
from srt.entrypoints.server_state import ServerState
from srt.server_args import ServerArgs
from srt.utils.heartbeat import Heartbeat
from srt.utils.process_guard import describe_state, process_state

SILENT = ("Scheduler process (pid 1234) has not answered for 7 s: it is stopped (SIGSTOP / SIGTSTP: it resumes "
          "on SIGCONT).")
STUCK = "Scheduler has not answered for 7 s: one step (a forward pass) is still running."
QUEUE_FULL = "The request queue is full. 1 requests are waiting (--max-queued-requests=1); retry later."


# ---------------------------------------------------------------------- the heartbeat
def test_heartbeat_tells_a_silent_process_from_a_long_step():
    beat = Heartbeat()
    assert beat.silent_for() < 1 and beat.step_running_for() == 0
    now = time.monotonic()
    assert beat.silent_for(now + 10) >= 10  # nobody beat for 10 s
    beat.step_begin()
    assert 5 <= beat.step_running_for(time.monotonic() + 5) < 6
    beat.step_end()
    assert beat.step_running_for(time.monotonic() + 5) == 0 and beat.steps == 1


def test_scheduler_watchdog_dumps_the_stuck_stack_and_reports_once(tmp_path):
    beat = Heartbeat()
    reports = []
    release = threading.Event()

    def stuck_forward_pass() -> None:  # a step that never returns on its own
        beat.step_begin()
        release.wait(10)
        beat.step_end()

    worker = threading.Thread(target=stuck_forward_pass, name="fake-scheduler-loop", daemon=True)
    worker.start()
    dump = tmp_path / "stacks.txt"
    with open(dump, "w") as f:
        SchedulerWatchdog(beat, 0.4, reports.append, interval=0.05, file=f).start()
        deadline = time.monotonic() + 5
        while not reports and time.monotonic() < deadline:
            time.sleep(0.02)
    release.set()
    worker.join(5)
    assert len(reports) == 1, reports
    assert reports[0].startswith("Scheduler watchdog: one scheduler step has run for")
    assert "--watchdog-timeout=0.4" in reports[0] and "stack" in reports[0]
    assert "stuck_forward_pass" in dump.read_text()  # the stuck thread's frame is in the dump
    assert beat.silent_for() < 1  # it beat the heartbeat while it watched


def test_scheduler_watchdog_beats_but_never_reports_when_disabled():
    beat = Heartbeat()
    reports = []
    beat.step_begin()
    SchedulerWatchdog(beat, 0, reports.append, interval=0.05).start()
    time.sleep(0.3)
    assert reports == [] and beat.silent_for() < 0.2


def test_process_state_names_a_stopped_process():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(proc.pid) != "T":
            assert time.monotonic() < deadline, process_state(proc.pid)
            time.sleep(0.02)
        assert describe_state(proc.pid).startswith("is stopped (SIGSTOP")
        os.kill(proc.pid, signal.SIGCONT)
        assert process_state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()
    assert describe_state(proc.pid) == "is gone"


# ---------------------------------------------------------------------- the HTTP routes (no model)
class FakeProcesses:
    def __init__(self) -> None:
        self.silent: Optional[str] = None
        self.stuck: Optional[str] = None

    def silent_scheduler(self, stale_s: float) -> Optional[str]:
        return self.silent

    def stuck_scheduler(self, stale_s: float) -> Optional[str]:
        return self.stuck

    def alive(self) -> bool:
        return True

    def pids(self) -> dict:
        return {}


class FakeTokenizerManager:
    """generate_request: `refuse` raises it at once; `hang` never answers; else one finished output."""

    def __init__(self) -> None:
        self.rid_to_state: dict = {}
        self.refuse: Optional[RequestError] = None
        self.hang = False
        self.calls = 0

    async def generate_request(self, obj: Any):
        self.calls += 1
        if self.refuse is not None:
            raise self.refuse
        if self.hang:
            await asyncio.sleep(3600)
        yield {"text": "x", "output_ids": [1], "meta_info": {"completion_tokens": 1, "finish_reason": {
            "type": "length", "length": 1}}}


def make_state() -> ServerState:
    info = SchedulerReady(True, max_total_num_tokens=100, max_req_input_len=90, max_req_len=95,
                          max_running_requests=4, context_len=128, vocab_size=1024)
    return ServerState(server_args=ServerArgs(model_path="unused"), tokenizer_manager=FakeTokenizerManager(),
                       scheduler_info=info, model_name="m", processes=FakeProcesses(), ready=True)


def call(state: ServerState, *requests_: tuple) -> list:
    """[(status, headers, json or None)] for each (method, path[, body])."""

    async def run() -> list:
        out = []
        async with TestClient(TestServer(create_app(state))) as client:
            for method, path, *body in requests_:
                resp = await client.request(method, path, json=body[0] if body else None)
                data = await resp.json() if resp.content_type == "application/json" and method != "HEAD" else None
                out.append((resp.status, resp.headers, data))
        return out

    return asyncio.run(run())


def test_head_health_answers_like_get():
    (head, _, _), (get, _, body) = call(make_state(), ("HEAD", "/health"), ("GET", "/health"))
    assert head == 200 and get == 200 and body == {"status": "ok"}


def test_silent_scheduler_fails_readiness_and_refuses_new_requests_but_not_liveness():
    state = make_state()
    state.processes.silent = SILENT
    (health, _, _), (ready, _, r), (hg, _, h), (gen, headers, g) = call(
        state, ("GET", "/health"), ("GET", "/ready"), ("GET", "/health_generate"),
        ("POST", "/generate", {"text": "Hi"}))
    assert health == 200
    assert ready == 503 and r["error"]["message"] == SILENT
    assert hg == 503 and SILENT in h["error"]["message"]
    assert gen == 503 and g["error"]["message"].startswith(SILENT) and headers["Retry-After"] == "1"
    assert state.tokenizer_manager.calls == 0  # refused before it reached the scheduler


def test_a_long_step_fails_readiness_but_requests_are_still_admitted():
    state = make_state()
    state.processes.stuck = STUCK
    (ready, _, r), (hg, _, _), (gen, _, _) = call(
        state, ("GET", "/ready"), ("GET", "/health_generate"), ("POST", "/generate", {"text": "Hi"}))
    assert ready == 503 and r["error"]["message"] == STUCK
    assert hg == 503
    assert gen == 200  # it queues behind the long step; the watchdog ends a step that never returns


def test_health_generate_gives_up_as_soon_as_the_scheduler_goes_silent():
    state = make_state()
    state.tokenizer_manager.hang = True

    async def go_silent() -> None:
        await asyncio.sleep(0.3)
        state.processes.silent = SILENT

    async def run() -> tuple:
        async with TestClient(TestServer(create_app(state))) as client:
            asyncio.get_running_loop().create_task(go_silent())
            t0 = time.monotonic()
            resp = await client.get("/health_generate")
            return resp.status, await resp.json(), time.monotonic() - t0

    status, body, took = asyncio.run(run())
    assert status == 503 and SILENT in body["error"]["message"]
    assert took < 2.0, took  # not the 20 s health-check timeout


def test_every_503_carries_retry_after():
    state = make_state()
    state.tokenizer_manager.refuse = RequestError(QUEUE_FULL, 503, code="service_unavailable")
    (gen, headers, body), = call(state, ("POST", "/generate", {"text": "Hi"}))
    assert gen == 503 and body["error"]["message"] == QUEUE_FULL and headers["Retry-After"] == "1"
    state.tokenizer_manager.refuse = RequestError("bad", 400)
    (bad, headers, _), = call(state, ("POST", "/generate", {"text": "Hi"}))
    assert bad == 400 and "Retry-After" not in headers


# ---------------------------------------------------------------------- a real server: queue full
@pytest.fixture(scope="module")
def limited(llama_model):
    with running_server(llama_model, "--max-running-requests", "1", "--max-queued-requests", "1") as handle:
        yield handle


LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}


def _fill_the_queue(handle) -> tuple:
    """One request running and one waiting: the next one is refused (queue full)."""
    running = handle.post("/generate", json={"text": "Runs", "stream": True, "sampling_params": LONG}, stream=True)
    lines = running.iter_lines()  # kept: a dropped iterator closes the stream, which aborts the request
    next(line for line in lines if line)
    waiting = threading.Thread(target=lambda: handle.post("/generate", json={"text": "Waits", "sampling_params": LONG}))
    waiting.start()
    deadline = time.monotonic() + 10
    while handle.get("/get_server_info").json()["load"]["num_waiting_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return (running, lines), waiting


def _release(handle, running, waiting) -> None:
    handle.post("/abort_request", json={"abort_all": True})
    waiting.join(30)
    running[0].close()


def test_queue_full_503_carries_retry_after_on_native_and_openai_routes(limited):
    running, waiting = _fill_the_queue(limited)
    try:
        native = limited.post("/generate", json={"text": "Refused", "sampling_params": {"max_new_tokens": 2}})
        openai = limited.post("/v1/completions", json={"model": "m", "prompt": "Refused", "max_tokens": 2})
    finally:
        _release(limited, running, waiting)
    for resp in (native, openai):
        assert resp.status_code == 503 and resp.headers.get("Retry-After") == "1", (resp.status_code, resp.headers)
        assert resp.json()["error"]["message"].startswith("The request queue is full.")


def test_queue_full_refusals_are_not_counted_as_aborts(limited):
    def counters() -> tuple:
        load = limited.get("/get_server_info").json()["load"]["counters"]
        return load["num_aborts"]

    running, waiting = _fill_the_queue(limited)
    try:
        before = counters()
        for _ in range(3):
            assert limited.post("/generate", json={"text": "Refused", "sampling_params": {"max_new_tokens": 2}}
                                ).status_code == 503
        after = counters()
    finally:
        _release(limited, running, waiting)
    assert after == before


def test_health_is_public_and_head_works_on_a_real_server(limited):
    assert requests.head(limited.url + "/health", timeout=10).status_code == 200
    assert limited.get("/ready").status_code == 200
