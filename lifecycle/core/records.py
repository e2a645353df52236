"""Domain values to the journal's records and back (pure; shared by actions and replay)."""

from __future__ import annotations

from lifecycle.core.config import Shape
from lifecycle.core.events import (
    GateDecided,
    GateRecord,
    PlanBuilt,
    PlannedRequest,
    PlatformRecord,
    ProbeFitRecord,
)
from lifecycle.core.gates import GateOutcome, Platform
from lifecycle.core.plan import ProbeFit, WarmupPlan


def platform_record(platform: Platform) -> PlatformRecord:
    return PlatformRecord(
        device=platform.device,
        name=platform.name,
        total_bytes=platform.total_bytes,
        free_bytes=platform.free_bytes,
        peak_source=platform.peak_source,
    )


def platform_from_record(record: PlatformRecord) -> Platform:
    return Platform(
        device=record.device,
        name=record.name,
        total_bytes=record.total_bytes,
        free_bytes=record.free_bytes,
        peak_source=record.peak_source,
    )


def gate_decided(
    *,
    outcomes: tuple[GateOutcome, ...],
    platform: Platform,
    skip_reason: str | None,
    local_skip_reason: str | None,
) -> GateDecided:
    return GateDecided(
        skip_reason=skip_reason,
        local_skip_reason=local_skip_reason,
        gates=tuple(GateRecord(name=o.name, passed=o.passed, reason=o.reason) for o in outcomes),
        platform=platform_record(platform),
    )


def probe_fit_record(fit: ProbeFit) -> ProbeFitRecord:
    fitted = fit.fitted
    return ProbeFitRecord(
        default_width=fit.default.width,
        default_height=fit.default.height,
        default_frames=fit.default.frames,
        fitted_width=fitted.width if fitted else None,
        fitted_height=fitted.height if fitted else None,
        fitted_frames=fitted.frames if fitted else None,
        estimated_peak_bytes=fit.estimated_peak_bytes,
        budget_bytes=fit.budget_bytes,
        free_bytes=fit.free_bytes,
        reserve_bytes=fit.reserve_bytes,
        frame_shrinks=fit.frame_shrinks,
        area_shrinks=fit.area_shrinks,
    )


def plan_built(plan: WarmupPlan) -> PlanBuilt:
    return PlanBuilt(
        skip_reason=plan.skip_reason,
        requests=tuple(
            PlannedRequest(
                role=r.role.value,
                width=r.shape.width,
                height=r.shape.height,
                frames=r.shape.frames,
                steps=r.steps,
            )
            for r in plan.requests
        ),
        probe_fit=probe_fit_record(plan.probe_fit) if plan.probe_fit else None,
    )


def fitted_shape(record: ProbeFitRecord | None) -> Shape | None:
    if record is None or record.fitted_width is None:
        return None
    assert record.fitted_height is not None
    assert record.fitted_frames is not None
    return Shape(
        width=record.fitted_width, height=record.fitted_height, frames=record.fitted_frames
    )
