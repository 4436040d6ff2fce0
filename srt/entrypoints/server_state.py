"""What every HTTP route handler may read: the front-end runtime of one server process."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from managers.io_struct import SchedulerReady


@dataclass
class ServerState:
    server_args: Any                     # srt.server_args.ServerArgs
    tokenizer_manager: Any               # managers.tokenizer_manager.TokenizerManager (same event loop)
    scheduler_info: SchedulerReady       # T, max_req_input_len, max_running_requests, context_len, vocab
    model_name: str                      # --served-model-name or the model path
    processes: Any = None                # srt.entrypoints.process_launcher.RuntimeProcesses
    started_time: float = field(default_factory=time.time)
    ready: bool = False                  # set after the warm-up request succeeded
    shutting_down: bool = False
    dead_reason: Optional[str] = None    # a runtime child died (the server exits right after)

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt + completion) the server accepts."""
        return min(self.scheduler_info.context_len, self.scheduler_info.max_req_len + 1)
