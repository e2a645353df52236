"""What bounds a /generate: a request whose predicted peak memory exceeds a rank's budget is
refused before it reaches the ranks, and one past the time predicted for it is stopped by every
rank after the same denoising step; either way the server keeps serving."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from lifecycle.core.decisions.admission import MemoryRule, RankMemory, admit, fits, largest_fitting
from lifecycle.core.decisions.requesttime import (
    DEADLINE_MARGIN,
    DEADLINE_SLACK_S,
    RequestCancelled,
    Timing,
    predict,
)
from lifecycle.core.errors import RequestAborted
from lifecycle.core.format.events import Error, RequestFinished, RequestStarted
from lifecycle.core.format.records import Shape
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from tests.plugins import ENV, STEP_PAUSE_S
from tests.support import BUDGET, OVER, SLOW, SMALL, journal_events, serve

MIB = 2**20
HUGE = {**SMALL, "width": 4096, "height": 4096, "frames": 257, "steps": 1}

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels) in /metrics' text."""
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def test_a_request_over_its_predicted_peak_is_refused_and_the_server_keeps_serving(
    tmp_path: Path,
) -> None:
    """Two ranks under a 1700 MiB budget: a request predicted over a rank's budget less its
    headroom (4096x4096x257 at one step among them) is a 422 naming the predicted
    peak, the budget and the largest shape of its aspect that fits, counted in /metrics and
    logged, and never reaches a rank; /health stays 200, and that largest shape and a small
    request then succeed."""
    extra = ("--num-ranks", "2", "--memory-budget", BUDGET, "--log-level", "info")
    with serve(tmp_path, *extra) as served:
        served.wait_for_health(200, within=180)
        over = served.client.post("/generate", json=OVER, headers={"X-Request-ID": "over-1"})
        assert over.status_code == 422, over.text[:300]
        answer = over.json()
        assert answer["request_id"] == "over-1" == over.headers["X-Request-ID"]
        assert answer["budget_bytes"] == 1700 * MIB
        assert answer["predicted_peak_bytes"] > answer["budget_bytes"] - answer["headroom_bytes"]
        assert "predicted peak" in answer["detail"] and "1.66 GiB" in answer["detail"]
        largest = answer["largest_fitting"]
        assert largest["frames"] == 81 and largest["width"] == largest["height"] < 1280
        assert largest["width"] % 16 == 0
        huge = served.client.post("/generate", json=HUGE, headers={"X-Request-ID": "huge-1"})
        assert huge.status_code == 422, huge.text[:300]
        assert huge.json()["predicted_peak_bytes"] > 10 * 2**30
        health = served.get("/health")
        assert health is not None and health.status_code == 200
        admission = served.client.get("/lifecycle").json()["admission"]["memory"]
        assert admission["rule"] == "predicted-peak"
        assert [r["budget_bytes"] for r in admission["ranks"]] == [1700 * MIB] * 2
        fitting = served.client.post("/generate", json={**OVER, **largest})
        assert fitting.status_code == 200, fitting.text[:300]
        small = served.client.post("/generate", json=SMALL)
        assert small.status_code == 200, small.text[:300]
        metrics = served.client.get("/metrics").text
        assert metric(metrics, 'lifecycle_requests_refused_total{reason="memory"}') == 2
        assert served.stop() == 0
    log = (tmp_path / "serve.log").read_text()
    assert "request_refused" in log and "request_id=over-1" in log
    started = {
        e.event.request_id for e in journal_events(served.db) if isinstance(e.event, RequestStarted)
    }
    assert not started & {"over-1", "huge-1"}


def test_a_request_past_its_deadline_is_cancelled_on_every_rank_at_the_same_step(
    tmp_path: Path,
) -> None:
    """Two ranks: a request at a shape served in well under a second, whose steps each take
    four seconds more, is cancelled past its deadline (3x the prediction + 5 s): a 504 naming the
    deadline and the step reached; every rank journals it ended, cancelled after that same
    step with why, with no collective left pending; /metrics counts it; /health stays 200
    and the next request succeeds."""
    extra = ("--pipeline", "tests.plugins:SLOWING", "--model", "slow-video")
    extra = (*extra, "--num-ranks", "2")
    with serve(tmp_path, *extra, env=ENV) as served:
        served.wait_for_health(200, within=180)
        fast = served.client.post("/generate", json=SMALL)
        assert fast.status_code == 200, fast.text[:300]
        cancelled = served.client.post("/generate", json=SLOW, headers={"X-Request-ID": "slow-1"})
        assert cancelled.status_code == 504, cancelled.text[:300]
        answer = cancelled.json()
        assert answer["request_id"] == "slow-1" == cancelled.headers["X-Request-ID"]
        assert DEADLINE_SLACK_S <= answer["deadline_s"] < 8 * STEP_PAUSE_S
        done = answer["steps_done"]
        assert 1 <= done < 8 and answer["steps"] == 8
        assert f"after step {done} of 8" in answer["detail"] and "deadline" in answer["detail"]
        health = served.get("/health")
        assert health is not None and health.status_code == 200
        after = served.client.post("/generate", json=SMALL)
        assert after.status_code == 200, after.text[:300]
        metrics = served.client.get("/metrics").text
        assert metric(metrics, 'lifecycle_requests_cancelled_total{reason="deadline"}') == 1
        assert served.stop() == 0
    events = journal_events(served.db)
    ended = {
        e.rank: e.event
        for e in events
        if isinstance(e.event, RequestFinished) and e.event.request_id == "slow-1"
    }
    assert sorted(ended) == [0, 1] and not any(f.ok for f in ended.values())
    why = {
        e.rank: e.event
        for e in events
        if isinstance(e.event, Error) and "slow-1" in e.event.message
    }
    assert sorted(why) == [0, 1]
    for error in why.values():
        assert not error.fatal and error.error_type == "RequestCancelled"
        assert f"cancelled after step {done} of 8: past its deadline" in error.message
    for finished in ended.values():
        assert all(g.started == g.finished for g in finished.groups), finished.groups
    shared = {g.group for g in ended[0].groups} & {g.group for g in ended[1].groups}
    marks = [{g.group: g.finished for g in ended[r].groups if g.group in shared} for r in (0, 1)]
    assert marks[0] == marks[1]


def test_predictions_follow_the_measured_shapes() -> None:
    """The same shape reads its own slowest recent step; a smaller one the nearest larger
    measured as it is; a larger one the largest measured, its steps by the tokens' ratio
    squared; the deadline is 3x the prediction plus 5 s."""
    small = Timing(tokens=100, pixels=1000, step_s=0.1, other_s=1.0)
    large = Timing(tokens=400, pixels=4000, step_s=0.5, other_s=2.0)
    same = predict([small, large], tokens=100, pixels=1000, steps=10)
    assert same is not None and same.seconds == pytest.approx(10 * 0.1 + 1.0)
    smaller = predict([small, large], tokens=50, pixels=500, steps=10)
    assert smaller is not None and smaller.seconds == pytest.approx(10 * 0.1 + 1.0)
    between = predict([small, large], tokens=200, pixels=2000, steps=10)
    assert between is not None and between.seconds == pytest.approx(10 * 0.5 + 2.0)
    beyond = predict([small, large], tokens=800, pixels=8000, steps=10)
    assert beyond is not None and beyond.seconds == pytest.approx(10 * 0.5 * 4 + 2.0 * 2)
    assert beyond.deadline_s == pytest.approx(DEADLINE_MARGIN * beyond.seconds + DEADLINE_SLACK_S)
    assert predict([], tokens=1, pixels=1, steps=1) is None


def test_the_largest_fitting_shape_fits_and_the_next_larger_does_not() -> None:
    """Across budgets, the largest shape named for a refused one keeps its aspect and frames,
    fits on every rank, and one grid step larger does not (none is named where not even the
    smallest fits); a request that fits is admitted."""
    args = ServerArgs(model=MODEL_PRESETS["micro-video"], num_ranks=2, ulysses=2)
    request = Shape(width=1920, height=1088, frames=81)
    for limit_mib in (300, 700, 1500, 5000):
        rule = MemoryRule(
            ranks=tuple(
                RankMemory(
                    rank=rank,
                    baseline_bytes=300 * MIB + rank * MIB,
                    scale=1.0 + rank / 10,
                    budget_bytes=(limit_mib + 1024) * MIB,
                    headroom_bytes=1024 * MIB,
                    budget_given=True,
                )
                for rank in (0, 1)
            )
        )
        refusal = admit(args, rule, request)
        if refusal is None:
            assert fits(args, rule, request)
            continue
        assert refusal.rank == 1  # the rank whose measured scale is higher
        largest = refusal.largest
        if largest is None:  # not even the grid's smallest of this aspect fits
            assert not fits(args, rule, Shape(width=16, height=16, frames=81))
            continue
        assert largest.frames == 81
        assert largest.width % 16 == 0 and largest.width > largest.height
        assert fits(args, rule, largest)
        wider = largest.width + 16
        assert not fits(
            args, rule, Shape(width=wider, height=wider * 1088 // 1920 // 16 * 16, frames=81)
        )
        assert largest_fitting(args, rule, largest) == largest


def test_a_rank_waits_at_its_point_and_stops_at_the_step_every_rank_agreed() -> None:
    """A rank's end of the cancel: it answers at once with the step after its last one made,
    goes no further until told, and stops at the agreed step, not before; a request not begun
    yet stops after its first step; a withdrawn cancel lets it go on; a request already
    answered is not answered again."""
    from lifecycle.serve.ranks.cancel import StepCancels
    from lifecycle.serve.ranks.messages import Cancel, CancelAt, CancelPoint

    sent: list[CancelPoint] = []
    cancels = StepCancels(rank=1, send=sent.append)
    cancels.begin("a")
    cancels.after_step("a", 0, steps=5, stopping=lambda: None)
    cancels.on_message(Cancel(request_id="a", reason="late"))
    assert sent == [CancelPoint(request_id="a", rank=1, step=1)]
    told = threading.Timer(
        0.3, cancels.on_message, args=(CancelAt(request_id="a", step=2, reason="late"),)
    )
    told.start()
    cancels.after_step("a", 1, steps=5, stopping=lambda: None)  # waits for the agreed step
    assert not told.is_alive()
    with pytest.raises(RequestCancelled) as stopped:
        cancels.after_step("a", 2, steps=5, stopping=lambda: None)
    assert (stopped.value.step, str(stopped.value)) == (
        2,
        "request a cancelled after step 3 of 5: late",
    )
    cancels.end("a")
    cancels.on_message(Cancel(request_id="a", reason="late"))
    assert len(sent) == 1
    cancels.on_message(Cancel(request_id="b", reason="late"))  # its Generate not read yet
    assert sent[-1] == CancelPoint(request_id="b", rank=1, step=0)
    cancels.begin("b")
    threading.Timer(
        0.3, cancels.on_message, args=(CancelAt(request_id="b", step=None, reason=""),)
    ).start()
    cancels.after_step("b", 0, steps=5, stopping=lambda: None)  # withdrawn: goes on
    cancels.after_step("b", 4, steps=5, stopping=lambda: None)
    cancels.begin("c")
    cancels.on_message(Cancel(request_id="c", reason="late"))
    with pytest.raises(RequestAborted):
        cancels.after_step("c", 0, steps=5, stopping=lambda: "server stopping")
