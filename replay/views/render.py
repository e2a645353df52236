"""The text tools replay prints with: cells, colour, tables, sizes and times (pure)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from lifecycle.core.format.text import clean, display_width
from replay.verdict.diagnose import Outcome


@dataclass(frozen=True, slots=True)
class Cell:
    """A table cell as printed (`shown`, which may carry styling) and as measured (`text`)."""

    text: str
    shown: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Style:
    color: bool = False

    def paint(self, text: object, code: str) -> str:
        """`text` cleaned of what a journal could smuggle in, then styled: our own escape
        sequences are the only ones printed."""
        value = clean(text)
        return f"\x1b[{code}m{value}\x1b[0m" if self.color else value

    def cell(self, text: object, code: str) -> Cell:
        return Cell(text=clean(text), shown=self.paint(text, code))

    def outcome_cell(self, outcome: Outcome | str) -> Cell:
        codes = {"ready": "32", "failed": "31", "hung": "33", "crashed": "31;1"}
        return self.cell(outcome, codes.get(str(outcome), "36"))

    def outcome(self, outcome: Outcome | str) -> str:
        return self.outcome_cell(outcome).shown

    def bold(self, text: object) -> str:
        return self.paint(text, "1")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned by display width; each cell is cleaned of control characters unless it is
    a `Cell`, whose text a `Style` already cleaned before styling it."""
    cells = [[_measured(c) for c in row] for row in (headers, *rows)]
    widths = [max(row[i][1] for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            shown + " " * (w - width) for (shown, width), w in zip(row, widths, strict=True)
        ).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def _measured(value: object) -> tuple[str, int]:
    """A cell as printed, and its display width (measured once: a table of 10,000 runs has
    90,000 cells)."""
    if isinstance(value, Cell):
        return value.shown, display_width(value.text)
    text = clean(value)
    return text, display_width(text)


def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def when(wall: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall)) + "Z"
    except (OverflowError, ValueError, OSError):
        return f"? (recorded time {wall!r})"
