"""The `warm-learned-shapes` action: after the bounded warmup, the shapes that the fingerprint's
traffic used (from the journal's served requests), the most used first, and those --warm-shape
names, each warmed as a warmup record of role `learned`, within --warm-budget. Rank 0 decides
which, and every rank warms the same (each warmup runs the group's collectives). See
docs/compile.md."""

from __future__ import annotations

from dataclasses import replace

import structlog
import torch

from lifecycle.core.decisions.learnedshapes import (
    LEARNED_WARM_STEPS,
    LearnedShape,
    LearnedTraffic,
    learned_shapes,
    warm_budget,
    within_budget,
)
from lifecycle.core.decisions.warmupplan import bounded_shape
from lifecycle.core.errors import ConfigError, JournalError
from lifecycle.core.format.events import ShapesChosen
from lifecycle.core.format.records import ChosenShape, Shape, SkippedShape
from lifecycle.core.settings.config import MAX_LEARNED_SHAPES
from lifecycle.core.settings.validation import validate_shape
from lifecycle.runtime.rankruntime import RankRuntime

log = structlog.get_logger("lifecycle.runtime")

_COLUMNS = 4  # width, height, frames, steps


def chosen_shapes(rt: RankRuntime) -> list[tuple[Shape, int]]:
    """This rank's choice of shapes to warm, with their steps: --warm-shape's first, then the
    learned ones that fit the budget, journaled as `shapes_chosen` (budget, costs, and why
    each learned shape left out was). A history that cannot be read teaches nothing."""
    args = rt.args
    steps = min(LEARNED_WARM_STEPS, args.model.default_steps)
    given = [
        ChosenShape(shape=shape, steps=steps, served=0, expected_s=None)
        for shape in args.warm_shapes
    ]
    assert rt.fingerprint is not None, "decide-path fingerprints the startup first"
    try:
        traffic = rt.recorder.served(rt.fingerprint.key)
    except JournalError as exc:
        log.warning("served_requests_unreadable", error=str(exc))
        traffic = LearnedTraffic(requests=[], ready_s=[])
    skip = [bounded_shape(args.model), *args.warm_shapes]
    learned: list[LearnedShape] = []
    unrunnable: list[SkippedShape] = []
    for shape in learned_shapes(traffic.requests, skip=skip):
        try:
            validate_shape(args.model, shape.shape, 1)  # a journal's row is not trusted blindly
        except ConfigError as exc:  # a shape this model cannot run is not warmed
            unrunnable.append(SkippedShape(shape=shape.shape, why=f"not runnable: {exc}"))
            continue
        learned.append(shape)
    budget = warm_budget(args.warm_budget_s, traffic.ready_s)
    # Under --compile, a shape not run yet compiles again when it is warmed: it costs about
    # what the startup's compile took, beside its steady-state time.
    compile_s = (rt.compile_seconds or 0.0) if args.enable_torch_compile else 0.0
    fitting, past = within_budget(learned, budget_s=budget.seconds, compile_s=compile_s)
    chosen = given + [replace(c, steps=min(steps, c.steps)) for c in fitting]
    if chosen or past or unrunnable or traffic.requests:
        rt.recorder.record(
            ShapesChosen(
                budget_s=budget.seconds,
                budget_basis=budget.basis,
                chosen=tuple(chosen[:MAX_LEARNED_SHAPES]),
                skipped=(*unrunnable, *past),
            )
        )
    return [(c.shape, c.steps) for c in chosen][:MAX_LEARNED_SHAPES]


def agreed_shapes(rt: RankRuntime, mine: list[tuple[Shape, int]]) -> list[tuple[Shape, int]]:
    """Rank 0's choice, on every rank: ranks reading other journals (one a node) or reading
    at other moments could choose otherwise, and a warmup that one rank runs alone hangs."""
    table = torch.zeros((MAX_LEARNED_SHAPES, _COLUMNS), dtype=torch.int64)
    if rt.layout.rank == 0:
        for row, (shape, steps) in enumerate(mine):
            table[row] = torch.tensor([shape.width, shape.height, shape.frames, steps])
    if rt.comm.world.size > 1:
        rt.comm.world.all_reduce(table, op="sum", purpose="learned-shapes-agree")
    return [
        (Shape(width=int(w), height=int(h), frames=int(f)), int(s))
        for w, h, f, s in table.tolist()
        if s > 0
    ]
