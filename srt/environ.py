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
