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


def say_fatal(message: str) -> None:
    """A fatal start-up or child-death message for the terminal: one plain line on stderr,
    written last, so it is what the user sees (no logging prefix, no traceback)."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
