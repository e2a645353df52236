"""The ordered, named gates that decide whether the calibration path runs (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lifecycle.core.decisions.warmupplan import bounded_shape
from lifecycle.core.format.records import GateOutcome, Platform
from lifecycle.core.settings.config import DisaggRole, PerformanceMode, ServerArgs, WarmupMode
from lifecycle.core.settings.modelspec import DIFFUSERS_BACKEND, VISUAL_TASKS


@dataclass(frozen=True, slots=True, kw_only=True)
class Gate:
    name: str
    reason: str  # the skip reason when this gate fails
    passes: Callable[[ServerArgs, Platform], bool]


RESIDENCY_PLANNER_NOT_AVAILABLE = "residency planner not available"
RESIDENCY_GATE = "residency-planner"


def _has_synthetic_warmup(args: ServerArgs, platform: Platform) -> bool:
    """A default shape above the bounded cap leaves a probe something new to measure; within
    it, only --calibrate asks for one (at the default shape, the bounded request's own)."""
    bounded = bounded_shape(args.model)
    return args.calibrate or bounded.pixels < args.model.default_shape.pixels


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
        passes=lambda a, p: a.model.backend != DIFFUSERS_BACKEND,
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
        name=RESIDENCY_GATE,
        reason=RESIDENCY_PLANNER_NOT_AVAILABLE,
        # The planner consumes the probe when the pipeline declares residency options;
        # --calibrate measures even without them.
        passes=lambda a, p: a.model.declares_residency or a.calibrate,
    ),
)
RESIDENCY_GATE_INDEX = len(GATES) - 1


def evaluate_gates(
    args: ServerArgs, platform: Platform, *, reuse: str | None = None
) -> tuple[GateOutcome, ...]:
    """Every gate's outcome, in order (the first failure is the one that decides).

    `reuse` names a verified residency plan this startup may apply instead of calibrating:
    the residency-planner gate then skips the probe with that as its reason, unless
    --calibrate asks for a calibration all the same.
    """
    outcomes = []
    for gate in GATES:
        passed, reason = gate.passes(args, platform), gate.reason
        if passed and gate.name == RESIDENCY_GATE and reuse is not None and not args.calibrate:
            passed, reason = False, reuse
        outcomes.append(GateOutcome(name=gate.name, passed=passed, reason=reason))
    return tuple(outcomes)


def calibration_skip_reason(
    args: ServerArgs, platform: Platform, *, reuse: str | None = None
) -> str | None:
    """The reason of the first gate that fails, or None when calibration runs."""
    failed = (o for o in evaluate_gates(args, platform, reuse=reuse) if not o.passed)
    return next((o.reason for o in failed), None)
