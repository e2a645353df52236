"""Which of the shapes traffic used a startup warms, within a budget (pure). See
docs/compile.md."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lifecycle.core.decisions.compiling import compile_text
from lifecycle.core.decisions.weightskey import weights_text
from lifecycle.core.format.events import CompileEvent, ShapesChosen
from lifecycle.core.format.records import ChosenShape, Shape, SkippedShape
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
    """One request that a run of the fingerprint served and finished well: its shape, steps
    and seconds. A request that never finished (it stalled, failed or was cancelled) teaches
    nothing: its shape is not learned."""

    shape: Shape
    steps: int
    seconds: float


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
        per_step = [r.seconds / r.steps for r in requests if r.steps]
        expected = statistics.median(per_step) * LEARNED_WARM_STEPS if per_step else None
        learned.append(
            LearnedShape(shape=shape, served=len(requests), steps=steps, expected_s=expected)
        )
    learned.sort(key=lambda s: (-s.served, s.shape.pixels, str(s.shape)))
    return learned[:MAX_LEARNED_SHAPES]


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmBudget:
    """How long warming the learned shapes may take, and where that figure came from."""

    seconds: float
    basis: str


def warm_budget(given_s: float | None, ready_s: Sequence[float]) -> WarmBudget:
    """--warm-budget, or its default from the fingerprint's times to ready."""
    if given_s is not None:
        return WarmBudget(seconds=given_s, basis="--warm-budget")
    if not ready_s:
        return WarmBudget(seconds=WARM_BUDGET_FLOOR_S, basis="no startup of this fingerprint yet")
    median = statistics.median(ready_s)
    share = WARM_BUDGET_SHARE * median
    if share < WARM_BUDGET_FLOOR_S:
        return WarmBudget(
            seconds=WARM_BUDGET_FLOOR_S,
            basis=f"the floor ({WARM_BUDGET_SHARE:g} x the median ready {median:.1f} s is less)",
        )
    return WarmBudget(
        seconds=share,
        basis=f"{WARM_BUDGET_SHARE:g} x the median time to ready, {median:.1f} s,"
        f" of {len(ready_s)} startup(s)",
    )


NO_KNOWN_COST = "no finished request says what it costs"


def within_budget(
    shapes: Sequence[LearnedShape], *, budget_s: float, compile_s: float = 0.0
) -> tuple[tuple[ChosenShape, ...], tuple[SkippedShape, ...]]:
    """The shapes to warm, decided before any is (so that every rank warms the same ones): in
    order, each whose expected time, and under --compile a compile of its own (`compile_s`,
    what the startup's compile took), still fits what is left of the budget; the others with
    why. A shape with no known cost is never taken for free: it is left out."""
    left = budget_s
    chosen: list[ChosenShape] = []
    skipped: list[SkippedShape] = []
    for shape in shapes:
        if shape.expected_s is None:
            skipped.append(SkippedShape(shape=shape.shape, why=NO_KNOWN_COST))
            continue
        cost = shape.expected_s + compile_s
        if cost > left:
            skipped.append(
                SkippedShape(
                    shape=shape.shape,
                    why=f"expected {cost:.2f} s, {left:.2f} s of the budget left",
                )
            )
            continue
        chosen.append(
            ChosenShape(
                shape=shape.shape,
                steps=shape.steps,
                served=shape.served,
                expected_s=shape.expected_s,
                compile_s=compile_s,
            )
        )
        left -= cost
    return tuple(chosen), tuple(skipped)


def chosen_text(event: ShapesChosen) -> str:
    """A `shapes_chosen` event in a few words, as the boot's table and `replay show` say it."""
    warmed = ", ".join(
        f"{c.shape}"
        + ("" if c.expected_s is None else f" ~{c.expected_s + c.compile_s:.2f} s")
        + (f" (compile {c.compile_s:.1f} s)" if c.compile_s else "")
        for c in event.chosen
    )
    said = f"warm budget {event.budget_s:.1f} s ({event.budget_basis}): "
    said += f"warming {warmed}" if warmed else "nothing to warm"
    if event.skipped:
        said += "; left out " + ", ".join(f"{s.shape} ({s.why})" for s in event.skipped)
    return said


def paid_once_text(event: CompileEvent) -> str:
    """A step of what a startup pays once per fingerprint, in a few words."""
    if isinstance(event, ShapesChosen):
        return chosen_text(event)
    weights = weights_text(event)
    return compile_text(event) if weights is None else weights
