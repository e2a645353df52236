"""The warmup plan: which synthetic requests run at startup, at which shapes and steps (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from lifecycle.core.format.records import ProbeFit, Role, Shape, WarmupRequest, probe_reserve_bytes
from lifecycle.core.settings.config import ServerArgs, WarmupMode
from lifecycle.core.settings.modelspec import ModelSpec

# The bounded warmup request: the 480p bucket and 17 frames, as the field's video servers use.
BOUNDED_WIDTH = 832
BOUNDED_HEIGHT = 480
BOUNDED_FRAMES = 17
BOUNDED_STEPS = 2
CALIBRATION_STEPS_FLOOR = 4
GIB = 2**30

PROBE_DOES_NOT_FIT = "probe does not fit in free memory"


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupPlan:
    requests: tuple[WarmupRequest, ...]
    probe_fit: ProbeFit | None
    skip_reason: str | None  # why the calibration path does not run, or None when it does

    @property
    def calibration_open(self) -> bool:
        return self.skip_reason is None

    @property
    def probe(self) -> WarmupRequest | None:
        return next((r for r in self.requests if r.role is Role.PROBE), None)

    def by_role(self, role: Role) -> tuple[WarmupRequest, ...]:
        return tuple(r for r in self.requests if r.role is role)


def _valid_frames(model: ModelSpec, limit: int) -> int:
    """The largest frame count that follows the model's frame rule and is at most `limit`."""
    m = model.frame_multiple
    return max(1, 1 + ((limit - 1) // m) * m)


def _round_down(value: float, multiple: int) -> int:
    return max(multiple, int(value) // multiple * multiple)


def bounded_shape(model: ModelSpec) -> Shape:
    """The model's default shape capped at the 832x480 area bucket and 17 frames."""
    w, h = model.default_width, model.default_height
    cap_area = BOUNDED_WIDTH * BOUNDED_HEIGHT
    if w * h > cap_area:
        if w > h:
            w, h = min(w, BOUNDED_WIDTH), min(h, BOUNDED_HEIGHT)
        elif h > w:
            w, h = min(w, BOUNDED_HEIGHT), min(h, BOUNDED_WIDTH)
        else:
            side = _round_down(math.sqrt(cap_area), model.spatial_multiple)
            w = h = side
    frames = _valid_frames(model, min(model.default_frames, BOUNDED_FRAMES))
    return Shape(width=w, height=h, frames=frames)


def bounded_steps(model: ModelSpec, *, calibration_open: bool) -> int:
    steps = min(BOUNDED_STEPS, model.default_steps)
    if calibration_open:
        steps = min(model.default_steps, max(steps, CALIBRATION_STEPS_FLOOR))
    return steps


def fit_probe(args: ServerArgs, *, free_bytes: int, total_bytes: int) -> ProbeFit:
    """Shrink the default shape, frames first then area, until its estimated peak fits.

    Frames shrink down to the bounded request's frames and area down to the bounded area; a
    probe no larger than the bounded request would measure nothing new, so none is fitted then.
    """
    model = args.model
    reserve = probe_reserve_bytes(total_bytes)
    budget = free_bytes - reserve
    floor = bounded_shape(model)
    shape = model.default_shape
    frame_shrinks = area_shrinks = 0

    def estimate(s: Shape) -> int:
        return model.memory.estimate(tokens=-(-model.tokens(s) // args.ulysses), pixels=s.pixels)

    def fitted(fit: Shape | None, measured: Shape) -> ProbeFit:
        return ProbeFit(
            default=model.default_shape,
            fitted=fit,
            estimated_peak_bytes=estimate(measured),
            budget_bytes=budget,
            free_bytes=free_bytes,
            reserve_bytes=reserve,
            frame_shrinks=frame_shrinks,
            area_shrinks=area_shrinks,
        )

    while estimate(shape) > budget:
        if shape.frames > floor.frames:
            frames = _valid_frames(model, shape.frames - model.frame_multiple)
            shape = Shape(width=shape.width, height=shape.height, frames=max(frames, floor.frames))
            frame_shrinks += 1
            continue
        width = _round_down(shape.width * 0.9, model.spatial_multiple)
        height = _round_down(shape.height * 0.9, model.spatial_multiple)
        candidate = Shape(width=width, height=height, frames=shape.frames)
        if candidate.area <= floor.area or candidate == shape:
            return fitted(None, candidate)
        shape = candidate
        area_shrinks += 1
    return fitted(shape, shape)


def build_plan(
    args: ServerArgs,
    *,
    skip_reason: str | None,
    fit: ProbeFit | None = None,
    probe_shape: Shape | None = None,
) -> WarmupPlan:
    """The warmup plan for a gate decision.

    With calibration open, the probe runs at `probe_shape` (the shape every rank agreed on)
    or else at `fit`'s shape; with neither, the probe does not fit and calibration is skipped.
    """
    model = args.model
    if args.warmup_mode is WarmupMode.NONE:
        return WarmupPlan(requests=(), probe_fit=None, skip_reason=skip_reason)
    bounded = bounded_shape(model)
    shape = probe_shape if probe_shape is not None else (fit.fitted if fit else None)
    if skip_reason is None and shape is None:
        skip_reason = PROBE_DOES_NOT_FIT
    if skip_reason is not None or shape is None:
        steps = bounded_steps(model, calibration_open=False)
        request = WarmupRequest(role=Role.BOUNDED, shape=bounded, steps=steps)
        return WarmupPlan(requests=(request,), probe_fit=fit, skip_reason=skip_reason)
    steps = bounded_steps(model, calibration_open=True)
    return WarmupPlan(
        requests=(
            WarmupRequest(role=Role.BOUNDED, shape=bounded, steps=steps),
            WarmupRequest(role=Role.PROBE, shape=shape, steps=steps),
            WarmupRequest(role=Role.REWARM, shape=bounded, steps=steps),
        ),
        probe_fit=fit,
        skip_reason=None,
    )


def plan_for(
    args: ServerArgs, *, skip_reason: str | None, free_bytes: int, total_bytes: int
) -> WarmupPlan:
    """The plan one rank builds alone: fit the probe when the gates leave calibration open."""
    fit = (
        fit_probe(args, free_bytes=free_bytes, total_bytes=total_bytes)
        if skip_reason is None and args.warmup_mode is WarmupMode.SERVER
        else None
    )
    return build_plan(args, skip_reason=skip_reason, fit=fit)
