"""structlog configuration; only entry points call `configure_logging`."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(*, json: bool, level: str = "info", stream: TextIO | None = None) -> None:
    """Human console lines by default, JSON lines with `json`; both go to stderr."""
    out = stream or sys.stderr
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=out.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
