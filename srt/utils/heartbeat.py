"""A scheduler's heartbeat in shared memory: written by the scheduler process, read by the front.

Two clocks, so the front can tell the cases apart without a round trip through the sockets:
- `silent_for`: since the scheduler's heartbeat thread last ran. It grows only when the whole
  process is frozen (SIGSTOP, a debugger, a native call that holds the GIL).
- `step_running_for`: how long the current scheduler step has run (0 between steps). It grows
  during one long or stuck forward while the process itself is fine.
Values are `time.monotonic()` seconds (CLOCK_MONOTONIC: the same clock in every process).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any, Optional

_ALIVE, _STEP_START, _STEPS = 0, 1, 2


class Heartbeat:
    """Create in the front before spawning and pass to the child with the process arguments."""

    def __init__(self, ctx: Optional[Any] = None):
        self._values = (ctx or mp.get_context("spawn")).RawArray("d", 3)
        self._values[_ALIVE] = time.monotonic()  # "just started": loading weights counts as alive

    # ------------------------------------------------------------------ scheduler side
    def beat(self) -> None:
        self._values[_ALIVE] = time.monotonic()

    def step_begin(self) -> None:
        self._values[_STEP_START] = time.monotonic()

    def step_end(self) -> None:
        self._values[_STEP_START] = 0.0
        self._values[_STEPS] += 1

    # ------------------------------------------------------------------ front side
    def silent_for(self, now: Optional[float] = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self._values[_ALIVE])

    def step_running_for(self, now: Optional[float] = None) -> float:
        start = self._values[_STEP_START]
        return 0.0 if not start else max(0.0, (time.monotonic() if now is None else now) - start)

    @property
    def steps(self) -> int:
        return int(self._values[_STEPS])
