"""What every HTTP route handler may read: the front-end runtime of one server process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from managers.generate_input import RequestLimits
from managers.io_struct import SchedulerReady
from srt.environ import envs


@dataclass
class ServerState:
    server_args: Any                     # srt.server_args.ServerArgs
    tokenizer_manager: Any               # managers.tokenizer_manager.TokenizerManager (same event loop)
    scheduler_info: SchedulerReady       # T, max_req_input_len, max_running_requests, context_len, vocab
    model_name: str                      # --served-model-name or the model path
    processes: Any = None                # srt.entrypoints.process_launcher.RuntimeProcesses
    started_time: float = field(default_factory=time.time)
    ready: bool = False                  # set after the warm-up request succeeded
    shutting_down: bool = False          # SIGTERM / Ctrl-C: no new requests, in-flight ones drain
    dead_reason: Optional[str] = None    # a runtime child died (the server exits right after)
    stale_s: float = field(default_factory=envs.SCHEDULER_STALE_S.get)  # $SRT_SCHEDULER_STALE_S

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + completion) served as asked (`RequestLimits`, one formula)."""
        return RequestLimits.from_scheduler_info(self.scheduler_info).max_model_len

    def silent_scheduler(self) -> Optional[str]:
        """Why the scheduler is not answering at all (stopped or frozen for `stale_s`), or None."""
        return self.processes.silent_scheduler(self.stale_s) if self.processes is not None else None

    def unready_scheduler(self) -> Optional[str]:
        """Why the scheduler cannot serve promptly (silent, or one step running for `stale_s`), or None."""
        if self.processes is None:
            return None
        return self.processes.silent_scheduler(self.stale_s) or self.processes.stuck_scheduler(self.stale_s)
