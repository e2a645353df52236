"""A calibrated one-rank startup, written as today's lifecycle writes it or as version 1 did."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from lifecycle.core.decisions.gates import calibration_skip_reason, evaluate_gates
from lifecycle.core.decisions.warmupplan import WarmupPlan, build_plan, fit_probe
from lifecycle.core.format.codec import encode
from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    BuffersDropped,
    Event,
    GateDecided,
    PlanBuilt,
    RequestFinished,
    RequestStarted,
    Shutdown,
    Transition,
    WarmupRecord,
)
from lifecycle.core.format.records import Platform, Shape, WarmupRequest
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.store import Journal, RunRow
from tests.support import T0

GIB = 2**30
ARGS = ServerArgs(calibrate=True)
PLATFORM = Platform(
    device="cpu",
    name="test cpu",
    total_bytes=64 * GIB,
    free_bytes=48 * GIB,
    peak_source="linux-vmhwm",
)


def calibrated_plan() -> WarmupPlan:
    """The plan today's lifecycle builds for ARGS on PLATFORM: bounded, probe, re-warm."""
    assert calibration_skip_reason(ARGS, PLATFORM) is None
    fit = fit_probe(ARGS, free_bytes=PLATFORM.free_bytes, total_bytes=PLATFORM.total_bytes)
    return build_plan(ARGS, skip_reason=None, fit=fit)


def _warmup(request: WarmupRequest) -> WarmupRecord:
    return WarmupRecord(
        role=request.role,
        shape=request.shape,
        steps=request.steps,
        tokens=ARGS.model.tokens(request.shape),
        total_s=0.5,
        step_s=(0.2, 0.2),
        stages=(),
        memory_source="linux-vmhwm",
        baseline_bytes=100 * 2**20,
        peak_bytes=(300 if request.role == "probe" else 200) * 2**20,
        checksum="c0ffee",
    )


def startup_events() -> list[tuple[str, Event]]:
    """Each event of the startup with the rank's state after it, in journal order."""
    plan = calibrated_plan()
    bounded, probe, rewarm = plan.requests
    smoke = Shape(width=832, height=480, frames=17)
    return [
        ("gate-check", Transition(trigger="start", source="created", dest="gate-check")),
        ("gate-check", GateDecided(
            skip_reason=None, local_skip_reason=None,
            gates=evaluate_gates(ARGS, PLATFORM), platform=PLATFORM,
        )),
        ("gate-check", PlanBuilt(
            skip_reason=None, requests=plan.requests, probe_fit=plan.probe_fit
        )),
        ("bounded-warm", Transition(trigger="warm", source="gate-check", dest="bounded-warm")),
        ("bounded-warm", _warmup(bounded)),
        ("probe", Transition(trigger="calibrate", source="bounded-warm", dest="probe")),
        ("probe", _warmup(probe)),
        ("re-warm", Transition(trigger="rewarm", source="probe", dest="re-warm")),
        ("re-warm", _warmup(rewarm)),
        ("drop-buffers", Transition(trigger="drop", source="re-warm", dest="drop-buffers")),
        ("drop-buffers", BuffersDropped(
            buffers=2, bytes_freed=2**20, keys=("a", "b"), allocator_released_bytes=None
        )),
        ("ready", Transition(trigger="finish", source="drop-buffers", dest="ready")),
        ("ready", ActionStarted(action="ready")),
        ("ready", RequestStarted(
            request_id="r1", source="smoke", shape=smoke, steps=2, prompt_chars=10
        )),
        ("ready", RequestFinished(
            request_id="r1", ok=True, total_s=0.3, checksum="c0ffee", peak_bytes=None
        )),
        ("ready", ActionFinished(action="ready", duration_s=0.4, ok=True)),
        ("stopped", Transition(trigger="stop", source="ready", dest="stopped")),
        ("stopped", Shutdown(reason="test", signal=None, events_written=17, journal_write_s=0.0)),
    ]  # fmt: skip


def _flat(shape: Shape, prefix: str = "") -> dict[str, int]:
    return {
        f"{prefix}width": shape.width,
        f"{prefix}height": shape.height,
        f"{prefix}frames": shape.frames,
    }


def v1_row(event: Event) -> tuple[int, str]:
    """The version and payload a version 1 lifecycle wrote for `event`: plan_built,
    warmup_record and request_started flattened every shape into width, height and frames."""
    payload: dict[str, Any] = json.loads(encode(event))
    match event:
        case PlanBuilt():
            payload["requests"] = [
                {"role": r.role.value, **_flat(r.shape), "steps": r.steps} for r in event.requests
            ]
            fit = event.probe_fit
            if fit is not None:
                fitted = fit.fitted
                payload["probe_fit"] = {
                    **_flat(fit.default, "default_"),
                    "fitted_width": fitted.width if fitted else None,
                    "fitted_height": fitted.height if fitted else None,
                    "fitted_frames": fitted.frames if fitted else None,
                    "estimated_peak_bytes": fit.estimated_peak_bytes,
                    "budget_bytes": fit.budget_bytes,
                    "free_bytes": fit.free_bytes,
                    "reserve_bytes": fit.reserve_bytes,
                    "frame_shrinks": fit.frame_shrinks,
                    "area_shrinks": fit.area_shrinks,
                }
        case WarmupRecord() | RequestStarted():
            shape = payload.pop("shape")
            payload.update(_flat(Shape(**shape)))
        case _:
            return event.version, json.dumps(payload)
    return 1, json.dumps(payload)


def write_startup(db: Path, *, run_id: str, as_v1: bool) -> None:
    """The startup as run `run_id` of the journal at `db`, through the journal's writer, or
    (`as_v1`) as rows a version 1 lifecycle wrote, bypassing today's codec."""
    journal = Journal.open_for_write(str(db))
    journal.create_run(
        RunRow(run_id=run_id, created_at=T0, host="h", world_size=1,
               config=args_to_json(ARGS), lifecycle_version="0.1.0")
    )  # fmt: skip
    events = startup_events()
    if not as_v1:
        writer = journal.writer(run_id=run_id, rank=0)
        for seq, (state, event) in enumerate(events):
            writer.append(event, state=state, wall_time=T0 + 0.1 * (seq + 1), mono_ns=seq)
        writer.close()
    journal.close()
    if not as_v1:
        return
    with sqlite3.connect(db) as conn:
        for seq, (state, event) in enumerate(events):
            version, data = v1_row(event)
            conn.execute(
                "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version,"
                " state, data) VALUES (?, 0, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, seq, T0 + 0.1 * (seq + 1), seq, event.kind, version, state, data),
            )
