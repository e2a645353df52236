"""The ordered, named gates that decide whether the calibration path runs (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lifecycle.core.config import (
    VISUAL_TASKS,
    DisaggRole,
    PerformanceMode,
    ServerArgs,
    WarmupMode,
)
from lifecycle.core.plan import bounded_shape


@dataclass(frozen=True, slots=True, kw_only=True)
class Platform:
    """What the device can do and hold, probed once at gate-check."""

    device: str  # "cuda" or "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    peak_source: str | None  # "cuda-allocator", "linux-vmhwm", or None when unmeasurable

    @property
    def can_measure_peak(self) -> bool:
        return self.peak_source is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Gate:
    name: str
    reason: str  # the skip reason when this gate fails
    passes: Callable[[ServerArgs, Platform], bool]


@dataclass(frozen=True, slots=True, kw_only=True)
class GateOutcome:
    name: str
    passed: bool
    reason: str


RESIDENCY_PLANNER_NOT_AVAILABLE = "residency planner not available"


def _has_synthetic_warmup(args: ServerArgs, platform: Platform) -> bool:
    bounded = bounded_shape(args.model)
    return bounded.pixels < args.model.default_shape.pixels


GATES: tuple[Gate, ...] = (
    Gate(
        name="explicit-disable",
        reason="disabled by LIFECYCLE_DISABLE_AUTO_RESIDENCY",
        passes=lambda a, p: not a.disable_auto_residency,
    ),
    Gate(
        name="performance-mode",
        reason="performance mode is not auto",
        passes=lambda a, p: a.performance_mode is PerformanceMode.AUTO,
    ),
    Gate(
        name="disaggregated-role",
        reason="disaggregated role",
        passes=lambda a, p: a.disagg_role is DisaggRole.NONE,
    ),
    Gate(
        name="visual-task",
        reason="task is not visual generation",
        passes=lambda a, p: a.model.task in VISUAL_TASKS,
    ),
    Gate(
        name="pipeline-support",
        reason="pipeline does not support residency calibration",
        passes=lambda a, p: a.model.supports_residency_calibration,
    ),
    Gate(
        name="realtime-adapter",
        reason="realtime adapter present",
        passes=lambda a, p: not a.model.realtime_adapter,
    ),
    Gate(
        name="diffusers-backend",
        reason="diffusers backend",
        passes=lambda a, p: a.model.backend != "diffusers",
    ),
    Gate(
        name="graph-capture",
        reason="CUDA graph or torch.compile enabled",
        passes=lambda a, p: not (a.enable_cuda_graph or a.enable_torch_compile),
    ),
    Gate(
        name="cache-dit",
        reason="cache-DiT enabled",
        passes=lambda a, p: not a.enable_cache_dit,
    ),
    Gate(
        name="batching",
        reason="batching max size > 1",
        passes=lambda a, p: a.max_batch_size <= 1,
    ),
    Gate(
        name="peak-measurement",
        reason="platform cannot measure peak memory",
        passes=lambda a, p: p.can_measure_peak,
    ),
    Gate(
        name="warmup-mode",
        reason="warmup mode is not server",
        passes=lambda a, p: a.warmup_mode is WarmupMode.SERVER,
    ),
    Gate(
        name="synthetic-warmup",
        reason="no synthetic server warmup to calibrate from",
        passes=_has_synthetic_warmup,
    ),
    Gate(
        name="residency-planner",
        reason=RESIDENCY_PLANNER_NOT_AVAILABLE,
        # No residency planner consumes a measured peak yet; --calibrate opts in to measure.
        passes=lambda a, p: a.calibrate,
    ),
)


def evaluate_gates(args: ServerArgs, platform: Platform) -> tuple[GateOutcome, ...]:
    """Every gate's outcome, in order (the first failure is the one that decides)."""
    return tuple(
        GateOutcome(name=g.name, passed=g.passes(args, platform), reason=g.reason) for g in GATES
    )


def calibration_skip_reason(args: ServerArgs, platform: Platform) -> str | None:
    """The reason of the first gate that fails, or None when calibration runs."""
    for gate in GATES:
        if not gate.passes(args, platform):
            return gate.reason
    return None
