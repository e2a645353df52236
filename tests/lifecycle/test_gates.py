"""The ordered, named calibration gates."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lifecycle.core.decisions.gates import (
    GATES,
    RESIDENCY_PLANNER_NOT_AVAILABLE,
    calibration_skip_reason,
    evaluate_gates,
)
from lifecycle.core.decisions.warmupplan import build_plan, fit_probe
from lifecycle.core.format.records import Platform, Role
from lifecycle.core.settings.config import DisaggRole, PerformanceMode, ServerArgs, WarmupMode
from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec

TINY = MODEL_PRESETS["tiny-video"]
CPU = Platform(
    device="cpu", name="cpu", total_bytes=64 * 2**30, free_bytes=60 * 2**30,
    peak_source="linux-vmhwm",
)  # fmt: skip


def model(**changes: Any) -> ModelSpec:
    return dataclasses.replace(TINY, **changes)


# For each gate, the smallest change to an all-passing config that fails exactly that gate.
FAILING: dict[str, tuple[dict[str, Any], Platform]] = {
    "explicit-disable": ({"disable_auto_residency": True}, CPU),
    "performance-mode": ({"performance_mode": PerformanceMode.SPEED}, CPU),
    "disaggregated-role": ({"disagg_role": DisaggRole.DENOISER}, CPU),
    "visual-task": ({"model": model(task="text-to-audio")}, CPU),
    "pipeline-support": ({"model": model(supports_residency_calibration=False)}, CPU),
    "realtime-adapter": ({"model": model(realtime_adapter=True)}, CPU),
    "diffusers-backend": ({"model": model(backend="diffusers")}, CPU),
    "graph-capture": ({"enable_torch_compile": True}, CPU),
    "cache-dit": ({"enable_cache_dit": True}, CPU),
    "batching": ({"max_batch_size": 4}, CPU),
    "peak-measurement": ({}, dataclasses.replace(CPU, peak_source=None)),
    "warmup-mode": ({"warmup_mode": WarmupMode.NONE}, CPU),
    "synthetic-warmup": (
        {
            "calibrate": False,
            "model": model(default_width=832, default_height=480, default_frames=17),
        },
        CPU,
    ),
    "residency-planner": ({"calibrate": False, "model": model(declares_residency=False)}, CPU),
}

EXPECTED_REASONS = {
    "explicit-disable": "disabled by LIFECYCLE_DISABLE_AUTO_RESIDENCY",
    "performance-mode": "performance mode is not auto",
    "disaggregated-role": "disaggregated role",
    "visual-task": "task is not visual generation",
    "pipeline-support": "pipeline does not support residency calibration",
    "realtime-adapter": "realtime adapter present",
    "diffusers-backend": "diffusers backend",
    "graph-capture": "CUDA graph or torch.compile enabled",
    "cache-dit": "cache-DiT enabled",
    "batching": "batching max size > 1",
    "peak-measurement": "platform cannot measure peak memory",
    "warmup-mode": "warmup mode is not server",
    "synthetic-warmup": "no synthetic server warmup to calibrate from",
    "residency-planner": "residency planner not available",
}


def test_gates_are_in_the_designed_order() -> None:
    """The gate list mirrors the field's, in order, ending with the residency planner."""
    assert [g.name for g in GATES] == list(EXPECTED_REASONS)
    assert GATES[-1].reason == RESIDENCY_PLANNER_NOT_AVAILABLE


@pytest.mark.parametrize("gate_name", list(FAILING))
def test_a_config_failing_one_gate_gets_exactly_its_reason(gate_name: str) -> None:
    """A calibrating config changed to fail one gate is skipped with that gate's reason,
    and every other gate still passes."""
    changes, platform = FAILING[gate_name]
    args = ServerArgs(**{"calibrate": True, **changes})
    assert calibration_skip_reason(args, platform) == EXPECTED_REASONS[gate_name]
    failed = [o.name for o in evaluate_gates(args, platform) if not o.passed]
    assert failed == [gate_name]


def test_auto_mode_calibrates_when_the_pipeline_declares_residency_options() -> None:
    """The planner consumes the probe: auto mode opens calibration for tiny-video, whose
    pipeline declares options, and stops at the planner for one that declares none."""
    assert calibration_skip_reason(ServerArgs(), CPU) is None
    plain = ServerArgs(model=model(declares_residency=False))
    assert calibration_skip_reason(plain, CPU) == "residency planner not available"


def test_a_verified_plan_to_reuse_skips_the_probe_unless_calibrate_is_given() -> None:
    """A reusable plan fails the planner gate with the reason that names it; --calibrate
    calibrates all the same; an earlier gate still decides first."""
    reuse = "verified residency plan vae=tiles-2x2 from run r1"
    assert calibration_skip_reason(ServerArgs(), CPU, reuse=reuse) == reuse
    outcomes = evaluate_gates(ServerArgs(), CPU, reuse=reuse)
    assert [(o.name, o.reason) for o in outcomes if not o.passed] == [("residency-planner", reuse)]
    assert calibration_skip_reason(ServerArgs(calibrate=True), CPU, reuse=reuse) is None
    batching = ServerArgs(max_batch_size=2)
    assert calibration_skip_reason(batching, CPU, reuse=reuse) == "batching max size > 1"


def test_calibrate_passes_the_planner_gate_and_only_it() -> None:
    """--calibrate opens calibration (a pipeline without options then only measures), yet
    does not override any earlier gate but the synthetic warmup's (below)."""
    assert calibration_skip_reason(ServerArgs(calibrate=True), CPU) is None
    plain = ServerArgs(calibrate=True, model=model(declares_residency=False))
    assert calibration_skip_reason(plain, CPU) is None
    speed = ServerArgs(calibrate=True, performance_mode=PerformanceMode.SPEED)
    assert calibration_skip_reason(speed, CPU) == "performance mode is not auto"


def test_the_first_failing_gate_decides() -> None:
    """With several gates failing, the reason is the earliest one's."""
    args = ServerArgs(max_batch_size=2, warmup_mode=WarmupMode.NONE, enable_cache_dit=True)
    assert calibration_skip_reason(args, CPU) == "cache-DiT enabled"


def test_calibrate_calibrates_a_model_whose_default_shape_is_within_the_bounded_cap() -> None:
    """A default shape no larger than the bounded request skips calibration in auto mode, but
    --calibrate asks for it: the probe then runs at the default shape."""
    small = model(default_width=832, default_height=480, default_frames=17)
    assert (
        calibration_skip_reason(ServerArgs(model=small), CPU)
        == EXPECTED_REASONS["synthetic-warmup"]
    )
    asked = ServerArgs(model=small, calibrate=True)
    assert calibration_skip_reason(asked, CPU) is None
    fit = fit_probe(asked, free_bytes=CPU.free_bytes, total_bytes=CPU.total_bytes)
    assert fit.fitted == small.default_shape
    roles = [(r.role, r.shape) for r in build_plan(asked, skip_reason=None, fit=fit).requests]
    assert roles == [
        (Role.BOUNDED, small.default_shape),
        (Role.PROBE, small.default_shape),
        (Role.REWARM, small.default_shape),
    ]
