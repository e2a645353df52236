"""The rules every rank must agree on, one pure function each: the live path calls them on
what the ranks exchanged, and `replay verify` on what the journal recorded."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lifecycle.core.config import Shape
from lifecycle.core.gates import GATES, GateOutcome


def first_failed_gate(outcomes: Sequence[GateOutcome]) -> int:
    """The index of the first gate that failed; len(GATES) when every gate passed."""
    return next((i for i, o in enumerate(outcomes) if not o.passed), len(GATES))


def agreed_skip_reason(first_failed: Iterable[int]) -> str | None:
    """The skip reason every rank takes: the earliest failing gate of any rank, so that the
    ranks close calibration together if any one of them closes it; None when all passed."""
    earliest = min(first_failed, default=len(GATES))
    return None if earliest >= len(GATES) else GATES[earliest].reason


def agreed_probe_shape(fitted: Iterable[Shape | None]) -> Shape | None:
    """The probe every rank runs: the smallest that any rank fitted (by pixels, then frames,
    width, height, so that ties break the same way everywhere); None when any rank fits none."""
    shapes = list(fitted)
    if not shapes or any(s is None or s.pixels == 0 for s in shapes):
        return None
    return min(
        (s for s in shapes if s is not None), key=lambda s: (s.pixels, s.frames, s.width, s.height)
    )
