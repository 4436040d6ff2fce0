"""glibc malloc tuning for the CPU forward: applied once per process, and never over a user's own
MALLOC_* settings or SRT_CPU_MALLOC_TUNING=0. Each case runs in a fresh interpreter (mallopt
changes the whole process)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = "from srt.utils.host_allocator import tune_host_allocator as t; print(t(), t())"

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                                reason="mallopt thresholds are glibc's")


def _probe(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SRT_CPU_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


def test_applied_once_by_default():
    assert _probe() == "True True"


def test_a_users_malloc_setting_wins():
    assert _probe(MALLOC_TRIM_THRESHOLD_="0") == "False False"


def test_switched_off():
    assert _probe(SRT_CPU_MALLOC_TUNING="0") == "False False"


def test_a_prefill_sized_block_is_reused_not_remapped():
    """With the tuning, freeing and re-allocating a 16 MiB block returns the same heap address
    (no fresh zeroed mmap); this is what saves the page faults."""
    code = ("import ctypes; from srt.utils.host_allocator import tune_host_allocator as t; t(); "
            "libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]; "
            "sizes = [16 << 20] * 4; a = [libc.malloc(s) for s in sizes]; [libc.free(p) for p in a]; "
            "b = [libc.malloc(s) for s in sizes]; print(sorted(a) == sorted(b))")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SRT_CPU_MALLOC"))}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "True"
