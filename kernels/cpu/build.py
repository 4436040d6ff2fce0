"""JIT build of the C++ CPU kernels into `torch.ops.srt_cpu`, cached under the repo's build/ folder.

The first process on a machine compiles them (tens of seconds; scripts/setup_env.sh does it at
set-up time); later processes find the cached library. The code is compiled for the CPU it runs
on (-march=native), so the cache folder is keyed by that CPU's feature flags and the torch build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("paged_attention.cpp", "extend_attention.cpp", "elementwise.cpp", "gemm.cpp", "dense_gemm.cpp", "amx_gemm.cpp", "sampling.cpp",
           "decode_layers.cpp")
# -fopenmp: at::parallel_for is a header template whose OpenMP backend is a `#pragma omp parallel`
# compiled into the op itself; without the flag the pragma is ignored and every op ran on one
# thread. It links no second runtime: the library asks for libgomp.so.1, which torch has already
# loaded from its own lib/ folder, so the op shares torch's thread pool and thread count.
# -ffp-contract=fast: fused multiply-adds.
BASE_CFLAGS = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded on this machine."""


@functools.lru_cache(maxsize=None)
def load_cpu_kernels() -> bool:
    """Load `torch.ops.srt_cpu`, building it on first use. Once per process: loading registers
    the op namespace, which can happen only once. False, after one warning, when there is no
    C++ compiler or ninja or the build fails; the caller then keeps its torch path."""
    missing = missing_tools()
    if missing:
        logger.warning("C++ CPU kernels disabled: %s not found on PATH; attention uses the torch path.",
                       " and ".join(missing))
        return False
    try:
        build_and_load()
    except (KernelBuildError, RuntimeError, OSError, ImportError) as exc:
        detail = str(exc).strip().splitlines()[-12:]
        logger.warning("C++ CPU kernels failed to build; attention uses the torch path. %s: %s",
                       type(exc).__name__, "\n".join(detail))
        return False
    return True


def compiler() -> str:
    """The C++ compiler torch's extension tooling will call."""
    return os.environ.get("CXX", "c++")


def missing_tools() -> List[str]:
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin) is not None:
        # The `ninja` wheel installs next to the interpreter; torch looks for it on PATH only.
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    return [tool for tool in (compiler(), "ninja") if shutil.which(tool) is None]


def build_root() -> Path:
    """build/cpu_kernels in the source tree (git-ignored), or a user cache when that is read-only."""
    repo_build = Path(__file__).resolve().parents[2] / "build"
    if os.access(repo_build if repo_build.exists() else repo_build.parent, os.W_OK):
        return repo_build / "cpu_kernels"
    return Path.home() / ".cache" / "radix-serve" / "cpu_kernels"


def native_flags() -> List[str]:
    """-march=native when the compiler accepts it (the build is only ever used on this CPU)."""
    probe = subprocess.run([compiler(), "-march=native", "-x", "c++", "-E", "-", "-o", os.devnull],
                           input="", capture_output=True, text=True, timeout=60)
    return ["-march=native"] if probe.returncode == 0 else []


def cpu_tag(flags: List[str]) -> str:
    """What the compiled code depends on: the CPU's features, the flags, torch, the compiler."""
    import torch

    features = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                features = line
                break
    key = "|".join([platform.machine(), features, torch.__version__, compiler(), " ".join(flags)])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """One build at a time per folder, across processes. An flock dies with its holder, unlike
    torch's own `lock` file, which a killed build leaves behind and every later load would wait
    on forever: holding the flock proves no live build owns that file, so it is removed."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (folder / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_and_load() -> None:
    """Compile (or reuse) the library and load it into this process."""
    from torch.utils import cpp_extension

    flags = BASE_CFLAGS + native_flags()
    name = f"srt_cpu_kernels_{cpu_tag(flags)}"
    folder = build_root() / name
    sources = [str(CSRC / src) for src in SOURCES]
    fresh = not (folder / f"{name}.so").exists()
    if fresh:
        logger.info("Building the C++ CPU kernels in %s (once per machine).", folder)
    start = time.perf_counter()
    with build_lock(folder):
        cpp_extension.load(name=name, sources=sources, extra_cflags=flags, extra_ldflags=LDFLAGS,
                           build_directory=str(folder),
                           is_python_module=False, verbose=False)
    if fresh:
        logger.info("Built the C++ CPU kernels in %.1f s.", time.perf_counter() - start)


if __name__ == "__main__":  # scripts/setup_env.sh: build at set-up time so servers start fast
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(0 if load_cpu_kernels() else 1)
