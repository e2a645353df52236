"""Console logs on a terminal: coloured, unless NO_COLOR says otherwise (https://no-color.org)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
import structlog

from lifecycle.serve.logs import configure_logging


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as stderr does in an interactive shell."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _default_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def console_lines(monkeypatch: pytest.MonkeyPatch, no_color: str | None) -> str:
    """What `configure_logging` writes to a terminal for an event and an exception."""
    if no_color is None:
        monkeypatch.delenv("NO_COLOR", raising=False)
    else:
        monkeypatch.setenv("NO_COLOR", no_color)
    terminal = Terminal()
    configure_logging(json=False, stream=terminal)
    log = structlog.get_logger()
    log.info("state_entered", state="ready", rank=0)
    try:
        raise RuntimeError("warmup failed")
    except RuntimeError:
        log.exception("startup_failed", rank=0)
    return terminal.getvalue()


def test_console_logs_on_a_terminal_are_coloured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without NO_COLOR, the console renderer colours its lines on a terminal."""
    lines = console_lines(monkeypatch, None)
    assert "state_entered" in lines
    assert "\x1b[" in lines


@pytest.mark.parametrize("value", ["1", "0", "true", "no"])
def test_no_color_set_to_any_value_leaves_no_escape_sequence(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """NO_COLOR set to any value: console lines, tracebacks included, carry no escape sequence."""
    lines = console_lines(monkeypatch, value)
    assert "state_entered" in lines
    assert "warmup failed" in lines
    assert "\x1b[" not in lines


def test_an_empty_no_color_keeps_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    """NO_COLOR present but empty is unset, as no-color.org says."""
    assert "\x1b[" in console_lines(monkeypatch, "")


def test_logs_off_a_terminal_are_logfmt_without_colour(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that is not a terminal gets plain logfmt lines, NO_COLOR or not."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    stream = io.StringIO()
    configure_logging(json=False, stream=stream)
    structlog.get_logger().info("state_entered", state="ready")
    assert "event=state_entered" in stream.getvalue()
    assert "\x1b[" not in stream.getvalue()
