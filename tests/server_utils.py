"""A real `python -m srt.launch_server` subprocess for tests, on a free port.

    handle = start_server(model_path, "--api-key", "k")   # waits until /health_generate is 200
    requests.post(handle.url + "/generate", json=..., headers=handle.headers())
    handle.stop()

or, for a module-scoped fixture: `with running_server(model_path) as handle: yield handle`.
The server's stdout and stderr go to a log file (`handle.logs()`), shown when start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import requests

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ARGS = ("--dtype", "float32", "--device", "cpu", "--max-total-tokens", "65536")
START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env() -> Dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class ServerHandle:
    """A running server: `url` (http://127.0.0.1:PORT), its process, and the API key it requires."""

    url: str
    proc: subprocess.Popen
    api_key: Optional[str]
    port: int
    log_path: Path

    def headers(self, **extra: str) -> Dict[str, str]:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**auth, **extra}

    def get(self, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.get(self.url + path, headers=self.headers(**kw.pop("headers", {})), **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        kw.setdefault("timeout", 60)
        return requests.post(self.url + path, headers=self.headers(**kw.pop("headers", {})), **kw)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """Ctrl-C (the server stops its children and removes its sockets), then SIGKILL if needed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _arg_value(args: tuple, flag: str) -> Optional[str]:
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def start_server(model_path: Any, *extra_args: str, timeout: float = START_TIMEOUT_S,
                 wait_ready: bool = True, env: Optional[Dict[str, str]] = None) -> ServerHandle:
    """Launch a server on a free port with `DEFAULT_ARGS` (later `extra_args` override them) and
    wait until a real generation succeeds (`/health_generate` 200). `env` adds variables."""
    extra = tuple(str(a) for a in extra_args)
    port = int(_arg_value(extra, "--port") or free_port())
    cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1",
           "--port", str(port), *DEFAULT_ARGS, *extra]
    log = tempfile.NamedTemporaryFile(prefix=f"srt-server-{port}-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**server_env(), **(env or {})}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, _arg_value(extra, "--api-key"), port, Path(log.name))
    if wait_ready:
        try:
            wait_until_ready(handle, timeout)
        except BaseException:
            handle.stop(5)
            raise
    return handle


def wait_until_ready(handle: ServerHandle, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited with code {handle.proc.returncode} during start-up:\n"
                               f"{handle.logs()[-4000:]}")
        try:
            if handle.get("/health_generate", timeout=30).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{handle.logs()[-4000:]}")


@contextmanager
def running_server(model_path: Any, *extra_args: str, **kw: Any) -> Iterator[ServerHandle]:
    """`start_server` as a context manager (module- or session-scoped fixtures)."""
    handle = start_server(model_path, *extra_args, **kw)
    try:
        yield handle
    finally:
        handle.stop()


def sse_events(resp: requests.Response) -> list:
    """The `data:` payloads of an SSE response, in order (strings; `[DONE]` included)."""
    events, buf = [], b""
    for chunk in resp.iter_content(chunk_size=None):
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            assert event.startswith(b"data: "), event
            events.append(event[len(b"data: "):].decode())
    assert buf == b"", f"trailing bytes after the last event: {buf!r}"
    return events
