"""A results row that sets a measured time against the baseline time measured beside it."""

from __future__ import annotations

from bench.table import Row, format_ratio, format_seconds


def compared_seconds(
    *,
    figure: str,
    value_s: float,
    baseline_s: float,
    value_note: str = "",
    baseline_note: str = "",
    target: str,
    how: str,
) -> Row:
    """Both times in readable units, each followed by its note as written, and their ratio."""
    return Row(
        figure=figure,
        value=format_seconds(value_s) + value_note,
        baseline=format_seconds(baseline_s) + baseline_note,
        ratio=format_ratio(value_s / baseline_s),
        target=target,
        how=how,
    )
