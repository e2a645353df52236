"""Version 2 of plan_built, warmup_record and request_started: nested domain values, and
version 1 journals read as version 2."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from lifecycle.core.errors import CorruptEvent
from lifecycle.core.format.codec import decode, encode
from lifecycle.core.format.events import (
    GateDecided,
    Heartbeat,
    PlanBuilt,
    RequestStarted,
    ResidencyPlanned,
    WarmupRecord,
)
from lifecycle.core.format.phrases import reuse_text
from lifecycle.core.format.records import (
    Fingerprint,
    GateOutcome,
    PlannerInput,
    Platform,
    ProbeFit,
    ResidencyOption,
    ResidencyPlan,
    ReuseCode,
    ReuseDecision,
    Role,
    Shape,
    WarmupRequest,
)
from lifecycle.store.journal import Journal
from tests.replay.v1_startup import PLATFORM, calibrated_plan, startup_events, write_startup


def read_rank0(db: Path, run_id: str) -> list[object]:
    reader = Journal.open_for_read(str(db))
    try:
        return [stored.event for stored in reader.read(run_id=run_id, rank=0)]
    finally:
        reader.close()


def test_v1_rows_in_a_journal_read_as_todays_events(tmp_path: Path) -> None:
    """Version 1 plan_built, warmup_record and request_started rows in a real SQLite journal
    read back as the events today's lifecycle writes, with nested shapes and roles."""
    db = tmp_path / "j.db"
    write_startup(db, run_id="run-v1", as_v1=True)
    with sqlite3.connect(db) as conn:
        versions = dict(conn.execute("SELECT DISTINCT kind, version FROM events").fetchall())
    assert versions["plan_built"] == versions["warmup_record"] == versions["request_started"] == 1
    events = read_rank0(db, "run-v1")
    assert events == [event for _, event in startup_events()]
    plan = next(e for e in events if isinstance(e, PlanBuilt))
    assert plan.requests == calibrated_plan().requests
    assert [r.role for r in plan.requests] == [Role.BOUNDED, Role.PROBE, Role.REWARM]
    assert plan.probe_fit is not None and isinstance(plan.probe_fit.default, Shape)
    warmups = [e for e in events if isinstance(e, WarmupRecord)]
    assert [str(w.shape) for w in warmups] == [str(r.shape) for r in plan.requests]
    (request,) = [e for e in events if isinstance(e, RequestStarted)]
    assert request.shape == Shape(width=832, height=480, frames=17)


def test_new_rows_are_written_at_their_versions_with_nested_shapes(tmp_path: Path) -> None:
    """Today's writer stores warmup records and plans at version 2 and request starts at
    version 3, each shape a nested object."""
    db = tmp_path / "j.db"
    write_startup(db, run_id="run-v2", as_v1=False)
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT kind, version, data FROM events").fetchall()
    by_kind = {kind: (version, json.loads(data)) for kind, version, data in rows}
    assert (by_kind["warmup_record"][0], by_kind["request_started"][0]) == (2, 3)
    version, plan = by_kind["plan_built"]
    assert version == 2
    assert plan["requests"][0] == {
        "role": "bounded", "shape": {"width": 832, "height": 480, "frames": 17}, "steps": 4,
    }  # fmt: skip
    assert set(plan["probe_fit"]["default"]) == {"width", "height", "frames"}
    assert by_kind["request_started"][1]["shape"] == {"width": 832, "height": 480, "frames": 17}


def test_gate_decided_keeps_its_version_1_payload() -> None:
    """The gate outcomes and platform are written field for field as version 1 wrote them."""
    event = GateDecided(
        skip_reason="x", local_skip_reason=None,
        gates=(GateOutcome(name="batching", passed=False, reason="x"),), platform=PLATFORM,
    )  # fmt: skip
    assert event.version == 1
    assert json.loads(encode(event)) == {
        "skip_reason": "x",
        "local_skip_reason": None,
        "gates": [{"name": "batching", "passed": False, "reason": "x"}],
        "platform": {
            "device": "cpu", "name": "test cpu", "total_bytes": 64 * 2**30,
            "free_bytes": 48 * 2**30, "peak_source": "linux-vmhwm",
        },
    }  # fmt: skip
    back = decode("gate_decided", 1, encode(event))
    assert isinstance(back, GateDecided) and back == event
    assert isinstance(back.platform, Platform) and back.platform.can_measure_peak


def test_a_v1_probe_fit_that_fitted_nothing_reads_as_none() -> None:
    """A version 1 probe fit with null fitted fields reads back with `fitted` None."""
    flat = {
        "default_width": 1280, "default_height": 720, "default_frames": 81,
        "fitted_width": None, "fitted_height": None, "fitted_frames": None,
        "estimated_peak_bytes": 5, "budget_bytes": 4, "free_bytes": 6, "reserve_bytes": 2,
        "frame_shrinks": 3, "area_shrinks": 1,
    }  # fmt: skip
    event = decode("plan_built", 1, json.dumps(
        {"skip_reason": "probe does not fit in free memory", "probe_fit": flat, "requests": [
            {"role": "bounded", "width": 832, "height": 480, "frames": 17, "steps": 2}]}
    ))  # fmt: skip
    assert event == PlanBuilt(
        skip_reason="probe does not fit in free memory",
        requests=(
            WarmupRequest(role=Role.BOUNDED, shape=Shape(width=832, height=480, frames=17),
                          steps=2),
        ),
        probe_fit=ProbeFit(
            default=Shape(width=1280, height=720, frames=81), fitted=None,
            estimated_peak_bytes=5, budget_bytes=4, free_bytes=6, reserve_bytes=2,
            frame_shrinks=3, area_shrinks=1,
        ),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "payload", "reason"),
    [
        ("warmup_record", {"role": "bounded", "width": 8, "height": 8}, "missing field 'frames'"),
        ("request_started", {"request_id": "r", "source": "http", "width": "8", "height": 8,
                             "frames": 1, "steps": 1, "prompt_chars": 0}, "expected an integer"),
        ("plan_built", {"skip_reason": None, "probe_fit": None,
                        "requests": [{"role": "dragon", "width": 8, "height": 8, "frames": 1,
                                      "steps": 1}]},
         "expected one of bounded, learned, probe, rewarm"),
        ("plan_built", {"skip_reason": None, "probe_fit": None, "requests": [3]},
         "WarmupRequest: expected an object"),
    ],
)  # fmt: skip
def test_a_broken_v1_payload_is_refused_with_a_reason(
    kind: str, payload: dict[str, object], reason: str
) -> None:
    """A version 1 payload the upcaster cannot make whole is refused naming what is wrong."""
    with pytest.raises(CorruptEvent, match=reason):
        decode(kind, 1, json.dumps(payload))


def test_a_role_outside_the_enum_is_refused() -> None:
    """A warmup record whose role is not one of Role's values does not decode."""
    event = json.loads(encode(next(e for _, e in startup_events() if isinstance(e, WarmupRecord))))
    with pytest.raises(CorruptEvent, match=r"WarmupRecord\.role: expected one of"):
        decode("warmup_record", 2, json.dumps({**event, "role": "Bounded"}))


@pytest.mark.parametrize("number", ["1e400", "-1e400", "Infinity", "NaN"])
def test_a_number_the_encoder_refuses_is_not_decoded(number: str) -> None:
    """A float field that JSON reads as infinite or NaN is refused: it could not be written."""
    with pytest.raises(CorruptEvent, match="finite"):
        decode("heartbeat", 1, f'{{"uptime_s": {number}, "in_state_s": 0, "pending": null}}')
    assert decode("heartbeat", 1, '{"uptime_s": 1, "in_state_s": 0, "pending": null}') == (
        Heartbeat(uptime_s=1.0, in_state_s=0.0, pending=None)
    )


def test_a_version_2_request_start_reads_with_no_negative_prompt_guidance_or_seed() -> None:
    """A request journaled before version 3 had no negative prompt, and its guidance scale and
    seed were not journaled: it reads as version 3 saying so."""
    payload = {
        "request_id": "r1", "source": "http", "shape": {"width": 64, "height": 64, "frames": 5},
        "steps": 2, "prompt_chars": 5,
    }  # fmt: skip
    assert decode("request_started", 2, json.dumps(payload)) == RequestStarted(
        request_id="r1", source="http", shape=Shape(width=64, height=64, frames=5), steps=2,
        prompt_chars=5, negative_prompt_chars=0, guidance_scale=None, seed=None,
    )  # fmt: skip


def test_a_version_1_residency_plan_keeps_its_sentence_under_the_text_code() -> None:
    """Version 1 of residency_planned journaled why no plan was reused as a sentence; it reads
    as version 2's decision with the code `text` and that sentence, which replay and the
    console show as it was. Version 2 journals a code with its facts, not words."""
    option = ResidencyOption(component="vae", name="whole", peak_scale=1.0, time_scale=1.0,
                             reference=True)  # fmt: skip
    event = ResidencyPlanned(
        fingerprint=Fingerprint(
            model="m", model_config="c", default_shape="8x8x1", layout="ranks=1", device="cpu",
            total_bytes=1, torch="2", lifecycle="0", budget="b",
        ),
        plan=ResidencyPlan(
            choices=(option,), predicted_peak_bytes=1, predicted_s=1.0, budget_bytes=2,
            headroom_bytes=0, fits=True, reason="fits",
        ),
        given=PlannerInput(
            baseline_bytes=0, costs=(), options=(option,), total_bytes=1, free_bytes=1,
            budget_bytes=2,
        ),
        reuse=ReuseDecision(code=ReuseCode.NEVER_VERIFIED, model="m", plan_id="p", run_id="r"),
    )  # fmt: skip
    payload = json.loads(encode(event))
    assert payload["reuse"]["code"] == "never-verified" and payload["reuse"]["plan_id"] == "p"
    assert reuse_text(event.reuse) == "plan p from run r never verified"
    sentence = "plan p from run r never verified"
    old = decode("residency_planned", 1, json.dumps({**payload, "reuse": sentence}))
    assert isinstance(old, ResidencyPlanned)
    assert old.reuse == ReuseDecision(code="text", note=sentence)
    assert reuse_text(old.reuse) == sentence
