"""The rules every rank must agree on, one pure function each: the live path calls them on
what the ranks exchanged, and `replay verify` on what the journal recorded."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from lifecycle.core.config import Shape
from lifecycle.core.gates import GATES, RESIDENCY_GATE_INDEX, GateOutcome


def first_failed_gate(outcomes: Sequence[GateOutcome]) -> int:
    """The index of the first gate that failed; len(GATES) when every gate passed."""
    return next((i for i, o in enumerate(outcomes) if not o.passed), len(GATES))


def agreed_probe_shape(fitted: Iterable[Shape | None]) -> Shape | None:
    """The probe every rank runs: the smallest that any rank fitted (by pixels, then frames,
    width, height, so that ties break the same way everywhere); None when any rank fits none."""
    shapes = list(fitted)
    if not shapes or any(s is None or s.pixels == 0 for s in shapes):
        return None
    return min(
        (s for s in shapes if s is not None), key=lambda s: (s.pixels, s.frames, s.width, s.height)
    )


def reuse_token(reason: str | None) -> int:
    """A number naming the plan a rank would reuse, from the reason that names it (0: none),
    for the ranks to compare in a collective and `replay verify` from the journal."""
    if reason is None:
        return 0
    return int(hashlib.sha256(reason.encode()).hexdigest()[:15], 16)


def agreed_decision(
    first_failed: Sequence[int], tokens: Sequence[int], reuse: str | None
) -> tuple[str | None, bool]:
    """The skip reason every rank takes (None: calibrate) and whether it reuses a plan, from
    each rank's first failing gate and reuse token, and the reason naming this rank's plan
    (the same on every rank when they agree to reuse it)."""
    index, reused = agreed_gate(first_failed, tokens)
    if reused:
        return reuse, True
    return (GATES[index].reason if index < len(GATES) else None), False


def agreed_gate(first_failed: Sequence[int], tokens: Sequence[int]) -> tuple[int, bool]:
    """The gate decision every rank takes, from each rank's first failing gate and its reuse
    token: the earliest failing gate, and whether that is a reused residency plan.

    A plan is reused only when every rank found the same one, so that all run the same plan or
    none does; when the ranks found different plans (or some none), they calibrate.
    """
    earliest = min(first_failed, default=len(GATES))
    if earliest != RESIDENCY_GATE_INDEX:
        return earliest, False
    if any(t == 0 for i, t in zip(first_failed, tokens, strict=True) if i == earliest):
        return earliest, False  # the planner is not available on some rank
    if tokens and all(t == tokens[0] for t in tokens):
        return earliest, True
    return len(GATES), False


def agreed_rollback(failed: Iterable[bool]) -> tuple[int, ...]:
    """The ranks whose plan failed to apply or verify; any one rolls back every rank."""
    return tuple(rank for rank, bad in enumerate(failed) if bad)
