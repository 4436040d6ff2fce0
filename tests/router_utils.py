"""SGLang's own router (`sglang-router`, a test extra) in front of our workers, on loopback."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

import requests

from server_utils import free_port, server_env


def router_command() -> List[str]:
    exe = shutil.which("sglang-router") or str(Path(sys.executable).with_name("sglang-router"))
    return [exe, "launch"]


@contextmanager
def running_router(worker_urls: List[str], policy: str, *extra: str, timeout: float = 60.0) -> Iterator[str]:
    """`sglang-router launch --worker-urls ... --policy POLICY` on a free port; yields its URL."""
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=f"sglang-router-{port}-", suffix=".log", delete=False)
    cmd = [*router_command(), "--worker-urls", *worker_urls, "--policy", policy, "--host", "127.0.0.1",
           "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn", *extra]
    proc = subprocess.Popen(cmd, env=server_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}:\n{Path(log.name).read_text()[-3000:]}")
            try:
                if requests.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not ready:\n{Path(log.name).read_text()[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
