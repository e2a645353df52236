"""The results table: one frozen row per figure, rendered as text and as Markdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from lifecycle.core.command import extra as extra_of

NONE = "-"
COLUMNS = ("figure", "value", "baseline", "ratio", "target", "how measured")


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One figure: its value, the baseline measured beside it, their ratio, the goal set for
    it (and whether this run met it), and how it was measured."""

    figure: str
    value: str
    baseline: str = NONE
    ratio: str = NONE
    target: str = NONE
    how: str

    def cells(self) -> tuple[str, ...]:
        return (self.figure, self.value, self.baseline, self.ratio, self.target, self.how)


def missing_extra(figure: str, *, extra: str) -> Row:
    """The row in place of `figure`'s, which needs the lifecycle's `extra`, not installed."""
    return Row(
        figure=figure,
        value=NONE,
        how=f"the {extra} extra is not installed: pip install '{extra_of(extra)}'",
    )


def verdict(goal: str, *, met: bool) -> str:
    """A target and whether it was met, as the table states it."""
    return f"{goal}: {'met' if met else 'MISSED'}"


def at_most(value: float, limit: float, *, spec: str = "") -> str:
    """The target cell of a figure whose goal is at most `limit`: the limit written with the
    format spec `spec`, and whether `value` met it."""
    return verdict(f"<= {limit:{spec}}", met=value <= limit)


class RatioCells(TypedDict):
    """A row's ratio and target cells, to unpack into `Row(...)`."""

    ratio: str
    target: str


def ratio_at_most(ratio: float, limit: float, *, spec: str = "") -> RatioCells:
    """The ratio and target cells of a figure whose ratio's goal is at most `limit` (the limit
    written with the format spec `spec`)."""
    return RatioCells(ratio=format_ratio(ratio), target=at_most(ratio, limit, spec=spec))


def format_ratio(value: float) -> str:
    return f"{value:.3f}"


def format_seconds(seconds: float) -> str:
    """Seconds in the unit that keeps three significant digits readable."""
    magnitude = abs(seconds)
    if magnitude >= 1.0:
        return f"{seconds:.2f} s"
    if magnitude >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} us"


def render_text(rows: Sequence[Row]) -> str:
    """An aligned plain-text table; the last column is left ragged."""
    table = [COLUMNS, *(row.cells() for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS) - 1)]
    lines = []
    for index, line in enumerate(table):
        padded = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        lines.append("  ".join([*padded, line[-1]]).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in [*widths, len(COLUMNS[-1])]))
    return "\n".join(lines)


def render_markdown(rows: Sequence[Row]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines.extend("| " + " | ".join(cell(c) for c in row.cells()) + " |" for row in rows)
    return "\n".join(lines)
