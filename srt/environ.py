"""Every environment variable the runtime reads, declared once, typed, with one prefix."""

from __future__ import annotations

import os
from dataclasses import dataclass

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


class Envs:
    # Allow --context-length above what config.json derives (RoPE models may produce NaN past it).
    ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = EnvBool(PREFIX + "ALLOW_OVERWRITE_LONGER_CONTEXT_LEN")


envs = Envs()


@dataclass(frozen=True)
class EnvInt:
    name: str
    default: int = 0

    def get(self) -> int:
        raw = os.environ.get(self.name)
        return self.default if raw in (None, "") else int(raw)


# Test hook: retract one running request every N decode steps (0 = off), so retraction paths run
# in tests and soak runs, not only when memory happens to run out.
Envs.TEST_RETRACT_INTERVAL = EnvInt(PREFIX + "TEST_RETRACT_INTERVAL")
