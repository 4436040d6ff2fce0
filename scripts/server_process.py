"""A `python -m srt.launch_server` child for the scripts (soak, fuzz): launch on a free port, wait
until a real generation works, read the process tree's memory, stop it.

Tests have their own launcher (tests/server_utils.py); this one only needs the standard library,
`requests` and `psutil`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil
import requests

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss_mib(pid: int) -> Dict[str, float]:
    """RSS in MiB of `pid` and each of its descendants, keyed by process title (or name)."""
    out: Dict[str, float] = {}
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            title = " ".join(proc.cmdline()[:1]) or proc.name()
            key = title if title not in out else f"{title}#{proc.pid}"
            out[key] = proc.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return out


class LaunchedServer:
    """A server child this script owns: `url`, `pid`, `logs()`, `stop()`."""

    def __init__(self, model_path: str, server_args: Sequence[str], timeout: float = 300.0,
                 env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        cmd = [sys.executable, "-m", "srt.launch_server", "--model-path", str(model_path),
               "--host", "127.0.0.1", "--port", str(self.port), *server_args]
        log = tempfile.NamedTemporaryFile(prefix=f"srt-script-{self.port}-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        child_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1",
                         **(env or {}))
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=child_env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.logs()[-3000:]}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout:.0f} s:\n{self.logs()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> "LaunchedServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def split_server_args(argv: List[str]) -> tuple:
    """`script args -- server args`: the part after `--` goes to the launched server."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []
