"""The warmup plan: bounded request, calibration floor, and the probe fitted to free memory."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.decisions.gates import RESIDENCY_PLANNER_NOT_AVAILABLE
from lifecycle.core.decisions.warmupplan import (
    GIB,
    PROBE_DOES_NOT_FIT,
    bounded_shape,
    build_plan,
    fit_probe,
    plan_for,
)
from lifecycle.core.format.records import Role, Shape, probe_reserve_bytes
from lifecycle.core.settings.config import ServerArgs, WarmupMode
from lifecycle.core.settings.modelspec import MODEL_PRESETS, MemoryModel

TINY = MODEL_PRESETS["tiny-video"]
PLENTY = dict(free_bytes=60 * GIB, total_bytes=64 * GIB)


def test_bounded_shape_of_a_720p_video_model_is_832x480x17() -> None:
    """The 1280x720x81 default is capped to the 480p bucket and 17 frames."""
    assert bounded_shape(TINY) == Shape(width=832, height=480, frames=17)


def test_bounded_shape_keeps_orientation_and_small_defaults() -> None:
    """Portrait stays portrait, a square gets a square, and a small default is kept."""
    portrait = dataclasses.replace(TINY, default_width=720, default_height=1280)
    assert bounded_shape(portrait) == Shape(width=480, height=832, frames=17)
    square = dataclasses.replace(TINY, default_width=1024, default_height=1024)
    assert bounded_shape(square) == Shape(width=624, height=624, frames=17)
    small = dataclasses.replace(TINY, default_width=512, default_height=288, default_frames=9)
    assert bounded_shape(small) == Shape(width=512, height=288, frames=9)


def test_auto_mode_plans_one_bounded_request_at_two_steps() -> None:
    """With the planner gate closed the plan is exactly one bounded request at 2 steps."""
    plan = plan_for(ServerArgs(), skip_reason=RESIDENCY_PLANNER_NOT_AVAILABLE, **PLENTY)
    assert [(r.role, str(r.shape), r.steps) for r in plan.requests] == [
        (Role.BOUNDED, "832x480x17", 2)
    ]
    assert plan.skip_reason == RESIDENCY_PLANNER_NOT_AVAILABLE
    assert plan.probe is None


def test_calibrated_plan_is_bounded_probe_rewarm_at_the_four_step_floor() -> None:
    """With calibration open: bounded, probe at the default shape, bounded again, 4 steps."""
    plan = plan_for(ServerArgs(calibrate=True), skip_reason=None, **PLENTY)
    assert [(r.role, str(r.shape), r.steps) for r in plan.requests] == [
        (Role.BOUNDED, "832x480x17", 4),
        (Role.PROBE, "1280x720x81", 4),
        (Role.REWARM, "832x480x17", 4),
    ]
    assert plan.calibration_open


def test_step_floor_never_exceeds_the_default_steps() -> None:
    """A 3-step model calibrates at 3 steps, and bounds at 2."""
    model = dataclasses.replace(TINY, default_steps=3)
    calibrated = plan_for(ServerArgs(model=model, calibrate=True), skip_reason=None, **PLENTY)
    assert {r.steps for r in calibrated.requests} == {3}
    one_step = dataclasses.replace(TINY, default_steps=1)
    bounded = plan_for(ServerArgs(model=one_step), skip_reason="x", **PLENTY)
    assert [r.steps for r in bounded.requests] == [1]


def test_warmup_mode_none_plans_nothing() -> None:
    """No server warmup means no warmup requests at all."""
    plan = plan_for(ServerArgs(warmup_mode=WarmupMode.NONE), skip_reason="x", **PLENTY)
    assert plan.requests == ()


def sized(resident: int, per_token: int, per_pixel: int) -> ServerArgs:
    memory = MemoryModel(fixed_bytes=resident, bytes_per_token=per_token, bytes_per_pixel=per_pixel)
    return ServerArgs(model=dataclasses.replace(TINY, memory=memory), calibrate=True)


def test_probe_shrinks_frames_first_then_area() -> None:
    """Under a tight budget the probe first loses frames down to the bounded 17, then area."""
    args = sized(0, 0, 10)
    default = TINY.default_shape
    reserve = probe_reserve_bytes(8 * GIB)
    # Room for the default area at 33 frames only: frames shrink, area stays.
    budget_33 = 1280 * 720 * 33 * 10
    fit = fit_probe(args, free_bytes=budget_33 + reserve, total_bytes=8 * GIB)
    assert fit.fitted == Shape(width=1280, height=720, frames=33)
    assert fit.frame_shrinks == (81 - 33) // 4 and fit.area_shrinks == 0
    # Room for less than 1280x720x17: frames at the floor, then the area shrinks.
    budget_small = 1000 * 560 * 17 * 10
    fit = fit_probe(args, free_bytes=budget_small + reserve, total_bytes=8 * GIB)
    assert fit.fitted is not None
    assert fit.fitted.frames == 17
    assert fit.fitted.area < default.area
    assert fit.fitted.pixels * 10 <= budget_small
    assert fit.fitted.width % 16 == 0 and fit.fitted.height % 16 == 0
    assert fit.area_shrinks > 0


def test_probe_that_fits_nowhere_skips_calibration() -> None:
    """When not even a probe larger than the bounded request fits, calibration is skipped."""
    args = sized(10 * GIB, 0, 0)
    plan = plan_for(args, skip_reason=None, free_bytes=8 * GIB, total_bytes=8 * GIB)
    assert plan.skip_reason == PROBE_DOES_NOT_FIT
    assert [r.role for r in plan.requests] == [Role.BOUNDED]
    assert plan.probe_fit is not None and plan.probe_fit.fitted is None


def test_reserve_is_one_gib_or_a_fiftieth() -> None:
    """The free-memory reserve is max(1 GiB, total / 50)."""
    assert probe_reserve_bytes(8 * GIB) == GIB
    assert probe_reserve_bytes(141 * GIB) == 141 * GIB // 50


def test_an_agreed_probe_shape_overrides_the_local_fit() -> None:
    """The probe runs at the shape all ranks agreed on, not this rank's own fit."""
    args = ServerArgs(calibrate=True)
    fit = fit_probe(args, **PLENTY)
    agreed = Shape(width=1280, height=720, frames=49)
    plan = build_plan(args, skip_reason=None, fit=fit, probe_shape=agreed)
    assert plan.probe is not None and plan.probe.shape == agreed


@given(free_gib=st.floats(min_value=0.5, max_value=200.0))
def test_a_fitted_probe_always_fits_its_budget(free_gib: float) -> None:
    """Whatever the free memory, a fitted probe's estimate is within the budget, and it is
    never smaller than the bounded request."""
    args = ServerArgs(calibrate=True)
    free = int(free_gib * GIB)
    fit = fit_probe(args, free_bytes=free, total_bytes=max(free, 8 * GIB))
    if fit.fitted is not None:
        assert fit.estimated_peak_bytes <= fit.budget_bytes
        assert fit.fitted.pixels > bounded_shape(TINY).pixels
        assert (fit.fitted.frames - 1) % 4 == 0
