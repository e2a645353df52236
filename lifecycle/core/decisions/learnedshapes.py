"""Which of the shapes traffic used a startup warms, within a budget (pure). See the README's
"Compile and shapes, paid once per fingerprint"."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lifecycle.core.format.records import Shape
from lifecycle.core.settings.config import MAX_LEARNED_SHAPES

# The served requests a startup reads to learn shapes from: the newest runs of its fingerprint,
# and of each the newest requests (bounded reads, on a journal of months of serving).
LEARN_RUNS = 16
LEARN_REQUESTS_PER_RUN = 1000
# A learned shape is warmed at a few steps: what a shape costs the first time (compiling,
# allocating, planning kernels) is paid by its first step; the others add nothing to learn.
LEARNED_WARM_STEPS = 2
# --warm-budget's default: a quarter of the fingerprint's median time to ready, so that warming
# never makes a startup much longer than its history; with no history, this many seconds.
WARM_BUDGET_SHARE = 0.25
WARM_BUDGET_FLOOR_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    """One request that a run of the fingerprint served: its shape, steps and seconds (None
    when it did not finish)."""

    shape: Shape
    steps: int
    seconds: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnedTraffic:
    """What a fingerprint's newest healthy runs served, and their times to ready."""

    requests: list[Served]
    ready_s: list[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnedShape:
    shape: Shape
    served: int  # how many requests used it
    steps: int  # the step count most used at it
    expected_s: float | None  # a request's median time there, from history


def learned_shapes(served: Iterable[Served], *, skip: Sequence[Shape] = ()) -> list[LearnedShape]:
    """The shapes traffic used, the most used first (ties: the smaller first), without those
    in `skip` (warmed already), at most MAX_LEARNED_SHAPES."""
    by_shape: dict[Shape, list[Served]] = {}
    for request in served:
        by_shape.setdefault(request.shape, []).append(request)
    learned = []
    for shape, requests in by_shape.items():
        if shape in skip:
            continue
        steps = Counter(r.steps for r in requests).most_common(1)[0][0]
        per_step = [r.seconds / r.steps for r in requests if r.seconds is not None and r.steps]
        expected = statistics.median(per_step) * LEARNED_WARM_STEPS if per_step else None
        learned.append(
            LearnedShape(shape=shape, served=len(requests), steps=steps, expected_s=expected)
        )
    learned.sort(key=lambda s: (-s.served, s.shape.pixels, str(s.shape)))
    return learned[:MAX_LEARNED_SHAPES]


def warm_budget(given_s: float | None, ready_s: Sequence[float]) -> float:
    """--warm-budget, or its default from the fingerprint's times to ready."""
    if given_s is not None:
        return given_s
    if not ready_s:
        return WARM_BUDGET_FLOOR_S
    return max(WARM_BUDGET_FLOOR_S, WARM_BUDGET_SHARE * statistics.median(ready_s))


def within_budget(shapes: Sequence[LearnedShape], *, budget_s: float) -> tuple[LearnedShape, ...]:
    """The shapes to warm, decided before any is (so that every rank warms the same ones): in
    order, each whose expected time still fits what is left of the budget; a shape history
    has no time for is expected to cost what the most expensive one known does."""
    known = [s.expected_s for s in shapes if s.expected_s is not None]
    unknown_s = max(known, default=0.0)
    left = budget_s
    chosen = []
    for shape in shapes:
        cost = shape.expected_s if shape.expected_s is not None else unknown_s
        if cost > left:
            continue
        chosen.append(shape)
        left -= cost
    return tuple(chosen)
