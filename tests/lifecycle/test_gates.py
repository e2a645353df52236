"""The ordered, named calibration gates."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from lifecycle.core.config import (
    MODEL_PRESETS,
    DisaggRole,
    ModelSpec,
    PerformanceMode,
    ServerArgs,
    WarmupMode,
)
from lifecycle.core.gates import (
    GATES,
    RESIDENCY_PLANNER_NOT_AVAILABLE,
    Platform,
    calibration_skip_reason,
    evaluate_gates,
)

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
        {"model": model(default_width=832, default_height=480, default_frames=17)},
        CPU,
    ),
    "residency-planner": ({"calibrate": False}, CPU),
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


def test_auto_mode_without_opt_in_stops_at_the_planner() -> None:
    """The default auto-mode config passes every gate but the planner's."""
    assert calibration_skip_reason(ServerArgs(), CPU) == "residency planner not available"


def test_calibrate_passes_the_planner_gate_and_only_it() -> None:
    """--calibrate opens calibration, yet does not override any earlier gate."""
    assert calibration_skip_reason(ServerArgs(calibrate=True), CPU) is None
    speed = ServerArgs(calibrate=True, performance_mode=PerformanceMode.SPEED)
    assert calibration_skip_reason(speed, CPU) == "performance mode is not auto"


def test_the_first_failing_gate_decides() -> None:
    """With several gates failing, the reason is the earliest one's."""
    args = ServerArgs(max_batch_size=2, warmup_mode=WarmupMode.NONE, enable_cache_dit=True)
    assert calibration_skip_reason(args, CPU) == "cache-DiT enabled"
