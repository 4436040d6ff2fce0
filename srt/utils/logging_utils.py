"""One place that configures logging for every process of the runtime."""

from __future__ import annotations

import logging
import sys
import os

FORMAT = "[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int | None = None, prefix: str = "") -> None:
    """Idempotent: sets the root handler and level (env SRT_LOG_LEVEL or `level`, default INFO)."""
    level = level or os.environ.get("SRT_LOG_LEVEL", "INFO")
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    fmt = FORMAT if not prefix else f"[%(asctime)s {prefix}] %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level)
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, Http2ProbeFilter) for f in server_log.filters):
        server_log.addFilter(Http2ProbeFilter())


class Http2ProbeFilter(logging.Filter):
    """aiohttp logs an HTTP/2 prior-knowledge connection (sglang-router probes each worker for
    gRPC that way, then falls back to HTTP/1.1) as an ERROR with a traceback and the raw bytes.
    It is expected: keep one INFO line per peer instead."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "PRI/Upgrade" not in str(exc):
            return True
        peer = record.getMessage().rsplit(" ", 1)[-1]
        if peer in self.seen:
            return False
        self.seen.add(peer)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args, record.exc_info, record.exc_text = (
            "Refused an HTTP/2 (gRPC) probe from %s: this server speaks HTTP/1.1 (sglang-router then "
            "uses HTTP).", (peer,), None, None)
        return True


def say_fatal(message: str) -> None:
    """A fatal start-up or child-death message for the terminal: one plain line on stderr,
    written last, so it is what the user sees (no logging prefix, no traceback)."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
