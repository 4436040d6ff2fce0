"""Every environment variable the runtime reads, declared once, typed, with one prefix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

PREFIX = "SRT_"


@dataclass(frozen=True)
class EnvBool:
    name: str
    default: bool = False

    def get(self) -> bool:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        return raw.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class EnvInt:
    name: str
    default: int = 0

    def get(self) -> int:
        raw = os.environ.get(self.name)
        return self.default if raw in (None, "") else int(raw)


@dataclass(frozen=True)
class EnvFloat:
    name: str
    default: float = 0.0

    def get(self) -> float:
        raw = os.environ.get(self.name)
        if raw in (None, ""):
            return self.default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"${self.name} must be a number of seconds, got {raw!r}.") from None


@dataclass(frozen=True)
class EnvStr:
    name: str
    default: Optional[str] = None

    def get(self) -> Optional[str]:
        raw = os.environ.get(self.name)
        return self.default if raw in (None, "") else raw


class Envs:
    # Allow --context-length above what config.json derives (RoPE models may produce NaN past it).
    ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = EnvBool(PREFIX + "ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")
    # Test hook: retract one running request every N decode steps (0 = off), so retraction paths run
    # in tests and soak runs, not only when memory happens to run out.
    TEST_RETRACT_INTERVAL = EnvInt(PREFIX + "TEST_RETRACT_INTERVAL")
    # The API key when neither --api-key nor --api-key-file is given (a key on the command line is
    # readable by every local user in /proc/<pid>/cmdline; the environment is not).
    API_KEY = EnvStr(PREFIX + "API_KEY")
    # Readiness: a scheduler whose heartbeat is older than this many seconds, or whose current step
    # has run longer, is "not answering": /ready and /health_generate fail fast, and a silent one
    # (stopped, frozen) also gets new requests refused with 503 until it answers again.
    SCHEDULER_STALE_S = EnvFloat(PREFIX + "SCHEDULER_STALE_S", 5.0)
    # CPU: reorder linear weights into oneDNN's blocked layout after loading (srt/layers/cpu_weight_packing.py).
    CPU_WEIGHT_PACKING = EnvBool(PREFIX + "CPU_WEIGHT_PACKING", True)
    # CPU without bf16 matmul kernels: pack bf16 linear weights as fp32 (srt/layers/cpu_weight_packing.py).
    CPU_WIDEN_BF16 = EnvBool(PREFIX + "CPU_WIDEN_BF16", True)
    # CPU packed-linear kernels: auto | srt (kernels/cpu/gemm.py's panels) | onednn | amx (bf16 on AMX tiles)
    # | dense (fp32 weights as loaded, the dot kernel + BLAS; srt/layers/cpu_weight_packing.py).
    CPU_GEMM = EnvStr(PREFIX + "CPU_GEMM", "auto")
    # CPU: fused C++ RMSNorm, SiLU-and-mul and RoPE (kernels/cpu/elementwise.py) instead of torch ops.
    CPU_FUSED_OPS = EnvBool(PREFIX + "CPU_FUSED_OPS", True)
    # CPU: decode through the bound, flat op sequence of srt/model_executor/cpu_decode_runner.py.
    CPU_DECODE_RUNNER = EnvBool(PREFIX + "CPU_DECODE_RUNNER", True)
    # CPU: that runner's layers in one C++ call (kernels/cpu/csrc/decode_layers.cpp); 0 = its Python loop.
    CPU_DECODE_LAYER_OP = EnvBool(PREFIX + "CPU_DECODE_LAYER_OP", True)
    # CPU extend attention: auto | op (kernels/cpu's paged op) | sdpa (torch's, over gathered K/V).
    CPU_EXTEND_ATTENTION = EnvStr(PREFIX + "CPU_EXTEND_ATTENTION", "auto")
    # CPU: raise glibc malloc's mmap/trim thresholds so activations are reused (srt/utils/host_allocator.py).
    CPU_MALLOC_TUNING = EnvBool(PREFIX + "CPU_MALLOC_TUNING", True)


envs = Envs()
