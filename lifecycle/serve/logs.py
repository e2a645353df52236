"""structlog configuration; only entry points call `configure_logging`."""

from __future__ import annotations

import datetime
import json as jsonlib
import logging
import os
import sys
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error")
_JSON_LINES: list[bool] = [False]  # set by configure_logging: --json-logs


def configure_logging(*, json: bool, level: str = "info", stream: TextIO | None = None) -> None:
    """Console lines on a terminal (coloured unless NO_COLOR is set), logfmt lines elsewhere
    (a file, a pipe, a log collector: greppable and several times cheaper to render), JSON
    lines with `json`; all to stderr."""
    out = stream or sys.stderr
    _JSON_LINES[0] = json
    renderer: structlog.typing.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
    elif out.isatty():
        # https://no-color.org: NO_COLOR present and not empty turns colour off.
        renderer = structlog.dev.ConsoleRenderer(colors=not os.environ.get("NO_COLOR"))
    else:
        renderer = structlog.processors.LogfmtRenderer(
            key_order=["timestamp", "level", "event"], drop_missing=True
        )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        # One write per line (message and newline together): the ranks of a launcher share
        # its stderr, and print()'s two writes let another rank's line in between them.
        logger_factory=structlog.WriteLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def set_json_lines(on: bool) -> None:
    """Make `say`'s lines JSON (--json-logs) before logging is configured: a setting refused
    at start is reported as the rest of the run would be."""
    _JSON_LINES[0] = on


def json_lines() -> bool:
    """Whether --json-logs is on: every line the operator reads is JSON."""
    return _JSON_LINES[0]


def say(text: str, *, event: str, out: TextIO | None = None, **fields: Any) -> None:
    """One line for the operator: `text` as it is, or, with --json-logs, a JSON object as
    the logs are (`event`, the text and `fields`), so that every line is JSON there."""
    stream = out or sys.stdout
    if _JSON_LINES[0]:
        record = {
            "timestamp": datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z"),
            "level": "error" if event == "error" else "info",
            "event": event,
            "text": text,
            **fields,
        }
        text = jsonlib.dumps(record, default=str)
    stream.write(text + "\n")
    stream.flush()
