"""Admission by memory: a request's predicted peak on each rank, from the model's memory estimate
fitted to what this run's warmups measured, against the rank's budget (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lifecycle.core.decisions.residencyplanner import default_budget
from lifecycle.core.format.records import Shape, probe_reserve_bytes
from lifecycle.core.format.text import format_bytes
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import ModelSpec

PREDICTED_PEAK = "predicted-peak"
LIMITS_ONLY = "limits-only"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """One rank's memory as this run fitted it: what a request adds on top of what the rank
    holds, and the most it may reach."""

    rank: int
    baseline_bytes: int  # held before a request, as the rank's latest warmup measured
    # The model's estimate scaled up to the most any warmup measured over it (never down: a
    # small request's growth is hidden by the allocator's caching, a large one's is not).
    scale: float
    budget_bytes: int
    headroom_bytes: int
    budget_given: bool  # --memory-budget; else what the rank held and the device had free

    @property
    def limit_bytes(self) -> int:
        """The highest peak admitted: the budget less the probe's headroom, as the residency
        planner holds its plans."""
        return self.budget_bytes - self.headroom_bytes

    def peak(self, args: ServerArgs, shape: Shape) -> int:
        return self.baseline_bytes + math.ceil(self.scale * working_bytes(args, shape))


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRule:
    """How requests are admitted by memory: by every rank's predicted peak, or (`ranks`
    empty) by the accepted limits only, and why."""

    ranks: tuple[RankMemory, ...]
    why: str | None = None  # why by the limits only

    @property
    def rule(self) -> str:
        return PREDICTED_PEAK if self.ranks else LIMITS_ONLY


@dataclass(frozen=True, slots=True, kw_only=True)
class Refusal:
    """A request refused because its predicted peak exceeds a rank's limit."""

    shape: Shape
    rank: int  # the rank it exceeds most
    predicted_peak_bytes: int
    budget_bytes: int
    headroom_bytes: int
    largest: Shape | None  # the largest shape of its aspect and frames that fits, if any

    def text(self) -> str:
        fits = (
            f"; the largest of its aspect at {self.shape.frames} frames that fits is {self.largest}"
            if self.largest is not None
            else f"; no shape of its aspect at {self.shape.frames} frames fits"
        )
        return (
            f"{self.shape} needs a predicted peak of {format_bytes(self.predicted_peak_bytes)} on"
            f" rank {self.rank}, over its budget of {format_bytes(self.budget_bytes)} less"
            f" {format_bytes(self.headroom_bytes)} headroom{fits}"
        )


def working_bytes(args: ServerArgs, shape: Shape) -> int:
    """The model's estimate of what a request adds on one rank: its tokens shared among the
    Ulysses ranks (as the probe is fitted)."""
    model: ModelSpec = args.model
    return model.memory.estimate(
        tokens=-(-model.tokens(shape) // args.ulysses), pixels=shape.pixels
    )


def memory_rule(args: ServerArgs, views: Mapping[int, RankView]) -> MemoryRule:
    """Every rank's fitted memory, or why requests are admitted by the accepted limits only."""
    if working_bytes(args, args.model.default_shape) <= 0:
        return MemoryRule(ranks=(), why="the model declares no memory estimate")
    if len(views) < args.num_ranks:
        return MemoryRule(ranks=(), why="not every rank has measured its memory yet")
    ranks = []
    for rank, view in sorted(views.items()):
        fitted = rank_memory(args, view)
        if isinstance(fitted, str):
            return MemoryRule(ranks=(), why=f"rank {rank}: {fitted}")
        ranks.append(fitted)
    return MemoryRule(ranks=tuple(ranks))


def rank_memory(args: ServerArgs, view: RankView) -> RankMemory | str:
    """The rank's memory fitted to its warmups; or why it cannot be."""
    if view.gate is None:
        return "no platform probed yet"
    measured = [
        (record.baseline_bytes, record.peak_bytes, working_bytes(args, record.shape))
        for record in view.warmup_records
        if record.baseline_bytes is not None and record.peak_bytes is not None
    ]
    if not measured:
        return "no warmup measured its peak memory"
    baseline = measured[-1][0]
    scale = max([1.0, *((peak - base) / work for base, peak, work in measured if work > 0)])
    platform = view.gate.platform
    given = args.memory_budget_bytes
    # Without a budget, what the rank held (its first warmup's baseline) and what the device
    # had free beside it when it planned, less the headroom: the rank's free memory alone
    # would count what it already holds twice.
    budget = (
        given
        if given is not None
        else measured[0][0]
        + default_budget(free_bytes=platform.free_bytes, total_bytes=platform.total_bytes)
    )
    return RankMemory(
        rank=view.rank,
        baseline_bytes=baseline,
        scale=scale,
        budget_bytes=budget,
        headroom_bytes=probe_reserve_bytes(platform.total_bytes),
        budget_given=given is not None,
    )


def admit(args: ServerArgs, rule: MemoryRule, shape: Shape) -> Refusal | None:
    """None when `shape` fits on every rank (or the rule is the limits only); else the
    refusal, naming the rank it exceeds most and the largest shape of its aspect that fits."""
    if not rule.ranks:
        return None
    worst = max(rule.ranks, key=lambda r: r.peak(args, shape) - r.limit_bytes)
    if worst.peak(args, shape) <= worst.limit_bytes:
        return None
    return Refusal(
        shape=shape,
        rank=worst.rank,
        predicted_peak_bytes=worst.peak(args, shape),
        budget_bytes=worst.budget_bytes,
        headroom_bytes=worst.headroom_bytes,
        largest=largest_fitting(args, rule, shape),
    )


def fits(args: ServerArgs, rule: MemoryRule, shape: Shape) -> bool:
    return all(r.peak(args, shape) <= r.limit_bytes for r in rule.ranks)


def largest_fitting(args: ServerArgs, rule: MemoryRule, shape: Shape) -> Shape | None:
    """The largest shape with `shape`'s aspect and frames, on the model's grid, that fits on
    every rank; None when not even the smallest does. (A request's peak grows with its
    sides, so the sides are searched by halving.)"""
    m = args.model.spatial_multiple
    longer = max(shape.width, shape.height)

    def scaled(side: int) -> Shape:
        ratio = side / longer
        return Shape(
            width=max(m, int(shape.width * ratio) // m * m),
            height=max(m, int(shape.height * ratio) // m * m),
            frames=shape.frames,
        )

    low, high = 1, longer // m  # in units of the grid: the longer side's candidates
    if not fits(args, rule, scaled(low * m)):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(args, rule, scaled(middle * m)):
            low = middle
        else:
            high = middle - 1
    return scaled(low * m)
