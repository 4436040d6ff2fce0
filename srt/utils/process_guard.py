"""Runtime children never outlive the front process, and leave nothing behind when it dies.

Every child the launcher spawns runs `run_child(guard, target, *args)`: the guard asks Linux for
SIGUSR2 when the parent dies (PR_SET_PDEATHSIG, which even a SIGKILL of the parent triggers) and
starts a thread that checks the parent every `poll_s`. A child that finds itself orphaned removes
the IPC folder (the front process, killed with SIGKILL, cannot) and exits at once, without the
graceful stop its SIGTERM would do: a scheduler rank must not tell its TP peers "stop" on a dead
node's behalf, they have to see the rank as lost. `faulthandler` is armed on SIGUSR1 so anyone can
ask a child for the stack of every thread, even while its main thread is stuck in native code.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
STACK_DUMP_SIGNAL = signal.SIGUSR1
# Its handler checks that the parent is really gone: PR_SET_PDEATHSIG fires when the spawning
# *thread* exits, which is a false alarm when an Engine was built in a short-lived thread.
PARENT_DEATH_SIGNAL = signal.SIGUSR2
_ORPHAN_LOCK = threading.RLock()  # re-entered when the death signal lands while the main thread cleans up


def set_parent_death_signal(sig: int) -> bool:
    """Linux: deliver `sig` to this process when its parent thread exits. False where unsupported."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of `pid` from /proc (R running, S sleeping, T stopped, Z zombie, ...)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses, so split at the last ")".
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else None


def describe_state(pid: int) -> str:
    state = process_state(pid)
    words = {"T": "is stopped (SIGSTOP / SIGTSTP: it resumes on SIGCONT)", "t": "is stopped by a debugger",
             "D": "is in uninterruptible sleep (I/O or the device driver)", "Z": "has exited (zombie)",
             "R": "is running", "S": "is sleeping"}
    if state is None:
        return "is gone"
    return words.get(state, f"is in state {state}")


@dataclass
class ChildGuard:
    """What a child needs to notice that its parent died and clean up after it."""

    parent_pid: int
    cleanup_dir: Optional[str] = None  # the IPC folder: removed by whichever orphan gets there first
    poll_s: float = 0.2                # the watcher's period: the bound when the main thread is stuck
    _noticed: bool = field(default=False, init=False, repr=False)

    def orphaned(self) -> bool:
        return os.getppid() != self.parent_pid

    def install(self) -> None:
        """In the child's main thread, first thing: death signal, stack dumps, the watcher thread."""
        signal.signal(PARENT_DEATH_SIGNAL, lambda *_: self.orphaned() and self.exit_orphan())
        set_parent_death_signal(PARENT_DEATH_SIGNAL)
        try:
            faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, RuntimeError):  # no stderr (pythonw) or no such signal
            pass
        threading.Thread(target=self._watch, name="srt-parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self.orphaned():
            time.sleep(self.poll_s)
        self.exit_orphan()

    def exit_orphan(self) -> None:
        """Clean up and end the process now (nobody waits for an orphan: skip the slow teardown)."""
        self.on_orphaned()
        _flush_logs()
        os._exit(1)

    def on_orphaned(self) -> None:
        """Say so once and remove the IPC folder (any thread; idempotent)."""
        with _ORPHAN_LOCK:
            if self._noticed:
                return
            self._noticed = True
            logger.warning("Parent process %d is gone: this %s process exits (removing %s).", self.parent_pid,
                           _process_name(), self.cleanup_dir)
            if self.cleanup_dir:
                shutil.rmtree(self.cleanup_dir, ignore_errors=True)


def run_child(guard: ChildGuard, target: Callable[..., Any], *args: Any) -> None:
    """Entry point of every runtime child: install `guard`, run `target(*args)`; a target that
    returns because it noticed the orphaning itself (the detokenizer does) cleans up the same way."""
    guard.install()
    try:
        if not guard.orphaned():  # else the parent died before the death signal was armed
            target(*args)
    finally:
        if guard.orphaned():
            guard.exit_orphan()


def _process_name() -> str:
    import multiprocessing

    return multiprocessing.current_process().name


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
