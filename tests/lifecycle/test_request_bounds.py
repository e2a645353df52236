"""One request never takes the server down: a request whose step never ends fails alone and the
ranks are replaced by a new group that serves on; a request predicted past --request-timeout is
refused before it reaches the ranks; a client that leaves cancels its request at the next
denoising step; and a request that never finished teaches the next startup no shape."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from lifecycle.core.decisions.learnedshapes import (
    NO_KNOWN_COST,
    LearnedShape,
    warm_budget,
    within_budget,
)
from lifecycle.core.decisions.requesttime import Prediction, TimeBound, over_limit
from lifecycle.core.format.events import Error, RequestFinished, ShapesChosen, WarmupRecord
from lifecycle.core.format.records import Role, Shape
from lifecycle.store.journal import Journal
from tests.conftest import run_cli, wait_until
from tests.plugins import ENV
from tests.stalling import STUCK_PROMPT
from tests.support import SLOW, SMALL, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

FAST = ("--heartbeat-interval", "0.2")
HUGE = {**SMALL, "width": 4096, "height": 4096, "frames": 257, "steps": 1}


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels) in /metrics' text."""
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[-1])


def runs_of(db: Path) -> list[tuple[str, list[object]]]:
    """Each run of the journal, oldest first, with its events."""
    journal = Journal.open_for_read(str(db))
    try:
        runs = sorted(journal.runs(), key=lambda r: r.created_at)
        return [(r.run_id, [e.event for e in journal.read(run_id=r.run_id)]) for r in runs]
    finally:
        journal.close()


def test_a_request_whose_step_never_ends_fails_alone_and_new_ranks_serve_on(
    tmp_path: Path,
) -> None:
    """Two ranks, rank 1 stuck in a denoising step that never ends: past its deadline the
    request is cancelled, the ranks do not stop, and it is answered 500 naming rank 1 within
    seconds (not after the 720 s silence bound); /liveness stays 200 while /health says
    restarting; a new group (a new run) becomes ready and serves the next request; /lifecycle
    names the restart; the journal holds the failed run and the one that replaced it."""
    extra = ("--pipeline", "tests.stalling:STALLING", "--model", "stalling-video")
    with serve(tmp_path, *extra, "--num-ranks", "2", *FAST, env=ENV) as served:
        served.wait_for_health(200, within=180)
        first_run = served.client.get("/lifecycle").json()["run_id"]
        assert served.client.post("/generate", json=SMALL).status_code == 200
        began = time.monotonic()
        stuck = served.client.post("/generate", json={**SMALL, "prompt": STUCK_PROMPT}, timeout=180)
        assert time.monotonic() - began < 120
        assert stuck.status_code == 500, stuck.text[:400]
        answer = stuck.json()
        assert answer["culprit_rank"] == 1, answer
        assert answer["diagnose"].startswith(f"replay diagnose {first_run} ")
        liveness = served.get("/liveness")
        assert liveness is not None and liveness.status_code == 200
        seen = served.wait_for_health(200, within=180)
        assert 503 in seen or served.client.get("/lifecycle").json()["run_id"] != first_run
        shown = served.client.get("/lifecycle").json()
        assert shown["run_id"] != first_run
        (restart,) = shown["restarts"]["done"]
        assert restart["ended_run"] == first_run and restart["new_run"] == shown["run_id"]
        assert "failed" in restart["why"]
        after = served.client.post("/generate", json=SMALL)
        assert after.status_code == 200, after.text[:300]
        assert served.stop() == 0
    (old, old_events), (new, new_events) = runs_of(served.db)
    assert (old, new) == (first_run, shown["run_id"])
    assert any(isinstance(e, Error) and e.fatal for e in old_events)
    assert sum(isinstance(e, RequestFinished) and e.ok for e in new_events) == 2  # both ranks
    log = (tmp_path / "serve.log").read_text()
    assert f"restarted: run {new} replaces run {old}" in log
    assert "Traceback" not in log


def test_a_request_predicted_past_the_request_timeout_is_refused_before_the_ranks(
    tmp_path: Path,
) -> None:
    """4096x4096x257 at one step (the shape that held a server for 720 s) under the default
    --request-timeout, and the default shape at 200 steps under a 2 s one, are each a 422 (the
    second naming the predicted time and the limit, counted in /metrics); no rank journals
    either; /health stays 200 and a small request is served."""
    with serve(tmp_path, "--request-timeout", "2", *FAST) as served:
        served.wait_for_health(200, within=180)
        default = served.client.post("/generate", json={"prompt": "a cat", "steps": 200})
        assert default.status_code == 422, default.text[:300]
        detail = default.json()["detail"]
        assert "predicted to take" in detail and "over --request-timeout 2 s" in detail
        metrics = served.client.get("/metrics").text
        assert metric(metrics, 'lifecycle_requests_refused_total{reason="time"}') == 1
        assert served.client.post("/generate", json=SMALL).status_code == 200
        health = served.get("/health")
        assert health is not None and health.status_code == 200
        assert served.stop() == 0
    with serve(tmp_path, *FAST) as served:
        served.wait_for_health(200, within=180)
        huge = served.client.post("/generate", json=HUGE)
        assert huge.status_code == 422, huge.text[:300]
        assert served.stop() == 0
    started = [
        e
        for _, events in runs_of(served.db)
        for e in events
        if type(e).__name__ == "RequestStarted" and getattr(e, "source", "") == "http"
    ]
    assert len(started) == 1  # SMALL's, on the one rank


def test_a_client_that_leaves_cancels_its_request_and_teaches_no_shape(tmp_path: Path) -> None:
    """Two ranks: a client that gives up on an eight-step request of four seconds a step after
    six seconds has it cancelled at the next step on every rank (journaled, counted in
    /metrics, the server serving on); the next startup of the fingerprint warms the shape a
    finished request used, never the cancelled one's, and `replay show` says the warm budget
    and what it chose."""
    extra = ("--pipeline", "tests.plugins:SLOWING", "--model", "slow-video", "--num-ranks", "2")
    slow = {**SLOW, "width": 320, "height": 192}  # a shape of its own, never finished
    with serve(tmp_path, *extra, *FAST, env=ENV) as served:
        served.wait_for_health(200, within=180)
        with pytest.raises(httpx.ReadTimeout):
            served.client.post("/generate", json=slow, headers={"X-Request-ID": "gone-1"},
                               timeout=6)  # fmt: skip

        def cancelled() -> dict[int, RequestFinished]:
            return {
                stored.rank: stored.event
                for stored in _events(served.db)
                if isinstance(stored.event, RequestFinished) and stored.event.request_id == "gone-1"
            }

        wait_until(lambda: len(cancelled()) == 2, within=30, what="the cancel on every rank")
        assert not any(f.ok for f in cancelled().values())
        assert served.client.post("/generate", json=SMALL).status_code == 200
        metrics = served.client.get("/metrics").text
        assert metric(metrics, 'lifecycle_requests_cancelled_total{reason="client"}') == 1
        assert served.stop() == 0
    why = [
        s.event
        for s in _events(served.db)
        if isinstance(s.event, Error) and "gone-1" in s.event.message
    ]
    assert len(why) == 2 and all("its client disconnected" in e.message for e in why), why
    assert all(not e.fatal for e in why)
    booted = run_cli(
        "lifecycle",
        ["boot", *extra, "--db", "j.db", "--smoke-request", "off"],
        cwd=tmp_path,
        env=ENV,
        timeout=240,
    )
    assert booted.returncode == 0, booted.stderr[-2000:]
    _, (_, second) = runs_of(served.db)
    learned = [e.shape for e in second if isinstance(e, WarmupRecord) and e.role is Role.LEARNED]
    assert learned and all(s == Shape(width=256, height=192, frames=9) for s in learned), learned
    chosen = [e for e in second if isinstance(e, ShapesChosen)]
    assert len(chosen) == 1 and [c.shape for c in chosen[0].chosen] == [learned[0]]
    shown = run_cli("replay", ["show", "latest", "j.db"], cwd=tmp_path, timeout=120)
    assert "warm budget" in shown.stdout and "256x192x9" in shown.stdout, shown.stdout[-3000:]
    assert "320x192x9" not in shown.stdout


def _events(db: Path) -> list:  # type: ignore[type-arg]
    journal = Journal.open_for_read(str(db))
    try:
        return [e for run in journal.runs() for e in journal.read(run_id=run.run_id)]
    finally:
        journal.close()


def test_a_learned_shape_with_no_known_cost_is_never_free() -> None:
    """A learned shape no finished request priced is left out, even under a zero budget;
    a compile counts in each shape's cost under --compile; the budget says where it came
    from."""
    known = LearnedShape(shape=Shape(width=256, height=192, frames=9), served=3, steps=4,
                         expected_s=1.0)  # fmt: skip
    unknown = LearnedShape(shape=Shape(width=320, height=192, frames=9), served=9, steps=4,
                           expected_s=None)  # fmt: skip
    chosen, skipped = within_budget([unknown, known], budget_s=0.0)
    assert chosen == () and [s.why for s in skipped] == [
        NO_KNOWN_COST,
        "expected 1.00 s, 0.00 s of the budget left",
    ]
    chosen, skipped = within_budget([unknown, known], budget_s=5.0)
    assert [c.shape for c in chosen] == [known.shape] and len(skipped) == 1
    chosen, skipped = within_budget([known], budget_s=5.0, compile_s=16.0)
    assert chosen == () and "expected 17.00 s" in skipped[0].why
    assert warm_budget(None, []).basis == "no startup of this fingerprint yet"
    assert warm_budget(3.0, [100.0]).seconds == 3.0
    assert warm_budget(None, [100.0, 120.0]).seconds == pytest.approx(27.5)


def test_a_request_is_bounded_by_its_prediction_or_the_operators_limit() -> None:
    """The bound is the prediction's deadline, no longer than --request-timeout, and the limit
    alone with nothing measured; a prediction over the limit is a refusal naming both."""
    fast = Prediction(seconds=2.0, step_s=0.5, basis="this shape")
    assert TimeBound.of(fast, limit_s=3600).seconds == pytest.approx(11.0)
    assert TimeBound.of(fast, limit_s=4).seconds == 4
    assert "--request-timeout 4 s" in TimeBound.of(fast, limit_s=4).rule()
    assert TimeBound.of(None, limit_s=60).seconds == 60
    assert TimeBound.of(fast, limit_s=3600).stop_s(700.0) == pytest.approx(6.5)
    assert TimeBound.of(None, limit_s=60).stop_s(700.0) == 700.0
    assert over_limit(fast, limit_s=3600) is None
    said = over_limit(Prediction(seconds=5000.0, step_s=5000.0, basis="x"), limit_s=3600)
    assert said is not None and "5,000.0 s" in said and "--request-timeout 3600 s" in said
    assert json.dumps(said)  # one line of text
