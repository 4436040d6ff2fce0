"""Shared helpers of the error-contract suite: run `launch_server` to its exit, read the fatal
line, and copy a tiny model with one thing changed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

from server_utils import REPO_ROOT, free_port, server_env

GiB, MiB = 1 << 30, 1 << 20


def launch(*args: object, env: Optional[Dict[str, str]] = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`launch_server` with the test defaults (CPU, fp32, a free port) until it exits."""
    cmd = [sys.executable, "-m", "srt.launch_server", "--device", "cpu", "--dtype", "float32",
           "--port", str(free_port()), *(str(a) for a in args)]
    return subprocess.run(cmd, cwd=REPO_ROOT, env={**server_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def fatal_line(done: subprocess.CompletedProcess) -> str:
    """The last stderr line: where a failed start-up puts its cause."""
    lines = done.stderr.strip().splitlines()
    assert lines, f"no stderr (exit {done.returncode}); stdout: {done.stdout[-2000:]}"
    return lines[-1]


def assert_clean_failure(done: subprocess.CompletedProcess, code: int = 1) -> str:
    """Exit `code`, no traceback wall, no generic wrapper; returns the fatal line."""
    assert done.returncode == code, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "initialization failed" not in done.stderr.lower()
    return fatal_line(done)


def copy_model(src: Path, dst: Path, config: Optional[dict] = None, tokenizer_config: Optional[dict] = None,
               drop_tokenizer_keys: tuple = (), remove: tuple = ()) -> Path:
    """A copy of the model directory `src` with config.json / tokenizer_config.json keys changed."""
    shutil.copytree(src, dst)
    for name in remove:
        (dst / name).unlink(missing_ok=True)
    for name, changes, drops in (("config.json", config, ()),
                                 ("tokenizer_config.json", tokenizer_config, drop_tokenizer_keys)):
        if not changes and not drops:
            continue
        data = json.loads((dst / name).read_text())
        data.update(changes or {})
        for key in drops:
            data.pop(key, None)
        (dst / name).write_text(json.dumps(data))
    return dst


def parse_size(text: str) -> float:
    """'22.7 GiB' / '0.023 MiB' -> bytes."""
    number, unit = text.split()
    return float(number) * {"GiB": GiB, "MiB": MiB}[unit]


def find(pattern: str, text: str) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in {text!r}"
    return m


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
