"""What `lifecycle serve` tells of a startup's time: each rank's launch and startup to ready from
it in /lifecycle and /metrics, the step a request has got to, and the time history expects a
rank to need still."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from lifecycle.core.format.events import (
    ActionFinished,
    Event,
    Expectations,
    PlanBuilt,
    RunStarted,
    StoredEvent,
    Transition,
)
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.records import StateExpectation
from lifecycle.core.format.view import RankView
from lifecycle.serve.http.rankjson import rank_json
from tests.support import BODY, scrape, serve, value

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

# A request long enough on two cores to be seen between its steps.
LONG = {**BODY, "steps": 40}


def test_lifecycle_and_metrics_give_each_ranks_launch_and_its_steps(tmp_path: Path) -> None:
    """/lifecycle gives each rank's launch (its process start and imports within it) and its
    startup to ready from the launch, as /metrics does; while a /generate denoises, each rank's
    step; no time left to expect without history."""
    with serve(tmp_path, "--num-ranks", "2") as served:
        served.wait_for_health(200, within=180)
        ranks = served.client.get("/lifecycle").json()["ranks"]
        metrics = scrape(served)
        for rank in ranks:
            launch = rank["launch"]
            assert 0 < launch["imports_s"] < launch["launch_s"]
            assert 0 <= launch["process_started_s"] < launch["launch_s"]
            assert rank["startup_to_ready_s"] > launch["launch_s"]
            assert rank["eta_s"] is None and rank["step"] is None
            label = str(rank["rank"])
            launched = value(
                metrics["lifecycle_launch_seconds"], "lifecycle_launch_seconds", rank=label
            )
            assert launched == pytest.approx(launch["launch_s"], abs=0.001)
            ready = value(
                metrics["lifecycle_startup_to_ready_seconds"],
                "lifecycle_startup_to_ready_seconds",
                rank=label,
            )
            assert ready == pytest.approx(rank["startup_to_ready_s"], abs=0.001)
        replies: list[httpx.Response] = []

        def generate() -> None:
            # A client of its own: the one polling /lifecycle meanwhile keeps its connection.
            with httpx.Client(base_url=served.url, timeout=120.0) as client:
                replies.append(client.post("/generate", json=LONG))

        request = threading.Thread(target=generate)
        request.start()
        seen: dict[int, dict[str, int]] = {}
        deadline = time.monotonic() + 120
        while request.is_alive() and time.monotonic() < deadline and len(seen) < 2:
            for rank in served.client.get("/lifecycle").json()["ranks"]:
                if rank["step"] is not None:
                    seen[rank["rank"]] = rank["step"]
            time.sleep(0.1)
        request.join(timeout=120)
        assert replies and replies[0].status_code == 200, replies
        assert sorted(seen) == [0, 1], seen
        for step in seen.values():
            assert step["steps"] == LONG["steps"] and 0 <= step["done"] < LONG["steps"]
        # The server reads the ranks' steps as it folds the journal, every 0.2 s.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            after = [r["step"] for r in served.client.get("/lifecycle").json()["ranks"]]
            if after == [None, None]:
                break
            time.sleep(0.1)
        assert after == [None, None]
        assert served.stop() == 0


def _folded(*events: tuple[float, str, Event]) -> RankView:
    fold = RankFold(run_id="r", rank=0)
    for seq, (wall, state, event) in enumerate(events):
        fold.apply(
            StoredEvent(
                run_id="r", rank=0, seq=seq, wall_time=wall, mono_ns=0, state=state, event=event
            )
        )
    return fold.view()


STARTED = RunStarted(
    world_size=1, host="h", pid=1, lifecycle_version="0", torch_version="0",
    python_version="3", device="cpu", dist_backend=None,
    launcher_started_wall=95.0, process_started_wall=96.0, imports_s=4.0,
)  # fmt: skip
EXPECTED = Expectations(
    key="k",
    runs=6,
    states=tuple(
        StateExpectation(state=state, median_s=median, p95_s=median * 2, count=6, deadline_s=60)
        for state, median in (
            ("created", 1.0), ("gate-check", 2.0), ("bounded-warm", 3.0), ("probe", 10.0),
            ("re-warm", 4.0), ("drop-buffers", 0.5),
        )
    ),
)  # fmt: skip


def _warming(*, skip_reason: str | None) -> list[tuple[float, str, Event]]:
    return [
        (100.0, "created", STARTED),
        (101.0, "gate-check", Transition(trigger="start", source="created", dest="gate-check")),
        (102.0, "gate-check", PlanBuilt(skip_reason=skip_reason, requests=(), probe_fit=None)),
        (102.5, "gate-check", EXPECTED),
        (103.0, "bounded-warm", Transition(trigger="warm", source="gate-check",
                                             dest="bounded-warm")),
    ]  # fmt: skip


def test_eta_is_what_is_left_of_the_state_and_the_states_after_it_on_its_path() -> None:
    """A rank 1 s into bounded-warm (median 3 s) on the calibrating path has 2 s of it left and
    probe, re-warm and drop-buffers after it; on the bounded path, ready follows at once; a
    rank ready is expected in none, one without expectations has no eta, and its launch is
    its launcher's start to its first event."""
    calibrating = rank_json(_folded(*_warming(skip_reason=None)), now=104.0, exit_code=None)
    assert calibrating["eta_s"] == pytest.approx(2.0 + 10.0 + 4.0 + 0.5)
    assert calibrating["launch"] == {"launch_s": 5.0, "process_started_s": 1.0, "imports_s": 4.0}
    bounded = rank_json(_folded(*_warming(skip_reason="reused")), now=104.0, exit_code=None)
    assert bounded["eta_s"] == pytest.approx(2.0)
    late = rank_json(_folded(*_warming(skip_reason="reused")), now=110.0, exit_code=None)
    assert late["eta_s"] == 0.0
    ready = _folded(
        *_warming(skip_reason="reused"),
        (106.0, "ready", Transition(trigger="finish", source="bounded-warm", dest="ready")),
        (106.5, "ready", ActionFinished(action="mark-ready", duration_s=0.5, ok=True)),
    )
    done = rank_json(ready, now=107.0, exit_code=None)
    assert done["eta_s"] == 0.0 and done["startup_to_ready_s"] == pytest.approx(11.0)
    unknown = [e for e in _warming(skip_reason=None) if not isinstance(e[2], Expectations)]
    assert rank_json(_folded(*unknown), now=104.0, exit_code=None)["eta_s"] is None
