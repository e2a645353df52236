"""The agreed abort: when a rank fails for good, its peers learn it through the rendezvous
store within seconds, journal why they stop, and leave, instead of waiting in their next
collective until the process-group timeout (real rank processes on gloo, default timeout)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from lifecycle.core.format import events as ev
from tests.conftest import run_cli
from tests.support import journal_events, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]
MICRO = ["--model", "micro-video", "--heartbeat-interval", "0.2", "--log-level", "warning"]
# Seconds from the failure to its peers' stop: a few store polls and a journal write each.
WITHIN_S = 5.0


def diagnosis(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    done = run_cli("replay", ["diagnose", "latest", "j.db", "--json"], cwd=tmp_path)
    return json.loads(done.stdout)  # type: ignore[no-any-return]


@pytest.mark.slow
def test_a_rank_that_fails_stops_its_peer_within_seconds(tmp_path: Path) -> None:
    """Rank 1 raises in probe with the default 600 s process-group timeout: rank 0 journals
    `aborted` naming rank 1 and its error, its journal ends within seconds of rank 1's error,
    the boot exits 1, and the diagnosis names rank 1 as the culprit."""
    done = run_cli(
        "lifecycle", ["boot", *MICRO, "--num-ranks", "2", "--calibrate", "--fault",
                      "1:probe:raise", "--db", "j.db"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0: aborted (rank 1 failed)" in done.stdout
    events = journal_events(tmp_path / "j.db")
    (failure,) = [e for e in events if isinstance(e.event, ev.Error) and e.event.fatal]
    assert failure.rank == 1
    (aborted,) = [e for e in events if isinstance(e.event, ev.Aborted)]
    assert aborted.rank == 0 and aborted.event.failed_rank == 1
    assert (aborted.event.error_type, aborted.event.failed_state) == ("InjectedFault", "probe")
    assert aborted.event.announced_by == "rank" and aborted.event.learned_after_s < WITHIN_S
    last_of_rank0 = max(e.wall_time for e in events if e.rank == 0)
    assert last_of_rank0 - failure.wall_time < WITHIN_S
    doc = diagnosis(tmp_path)
    assert (doc["culprit_ranks"], doc["culprit_state"]) == ([1], "probe")
    assert {r["rank"]: r["status"] for r in doc["ranks"]}[0] in ("aborted", "blocked")


def test_the_fields_failure_ends_in_seconds_and_is_a_failure(tmp_path: Path) -> None:
    """Rank 1 raises in drop-buffers while rank 0 goes on to the next all-to-all: rank 0 is
    aborted within seconds, and the diagnosis is rank 1's failure. Rank 0 reaches that
    all-to-all in the millisecond rank 1 raises; where its journal shows it waiting there, it
    was aborted in that collective, waiting for rank 1, not hung in it. On a loaded host the
    abort can reach it a moment before it enters: then it was aborted waiting for nothing.
    Both are read from the journal, never assumed (the diagnosis of a rank aborted in a
    collective at its peer's raise is pinned, journal fixed, in tests/replay/test_victims)."""
    done = run_cli(
        "lifecycle", ["boot", *MICRO, "--num-ranks", "2", "--calibrate", "--fault",
                      "1:drop-buffers:raise", "--db", "j.db"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1] == (
        "boot: exit 1: rank 1 failed in drop-buffers; then rank 0 aborted (the agreed abort)"
    ), done.stdout[-2000:]
    doc = diagnosis(tmp_path)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "failed", [1], "drop-buffers",
    ), doc["summary"]  # fmt: skip
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert ranks[0]["status"] == "aborted", doc["summary"]
    pending = ranks[0]["pending_collective"]
    if _waited_in_a_collective(journal_events(tmp_path / "j.db"), rank=0):
        assert pending is not None and pending["waiting_for"] == [1], doc["summary"]
    else:
        assert pending is None, doc["summary"]
    assert not [e for e in doc["evidence"] if e["code"] == "blocked"], doc["summary"]
    assert any(e["code"] == "aborted" and e["rank"] == 0 for e in doc["evidence"])
    assert "aborted after" not in doc["summary"] and "hung" not in doc["summary"]


def _waited_in_a_collective(events: list[ev.StoredEvent], *, rank: int) -> bool:
    """Whether `rank`'s journal left a collective open (started, never finished) when it was
    aborted."""
    started = {(e.event.group, e.event.group_seq) for e in events
               if e.rank == rank and isinstance(e.event, ev.CollectiveStarted)}  # fmt: skip
    finished = {(e.event.group, e.event.group_seq) for e in events
                if e.rank == rank and isinstance(e.event, ev.CollectiveFinished)}  # fmt: skip
    return bool(started - finished)


@pytest.mark.slow
def test_on_peer_failure_wait_keeps_the_wait_until_the_timeout(tmp_path: Path) -> None:
    """With --on-peer-failure wait, nothing is aborted: rank 0 waits in its collective until
    the process-group timeout ends it, as under NCCL's watchdog."""
    done = run_cli(
        "lifecycle", ["boot", *MICRO, "--num-ranks", "2", "--calibrate", "--fault",
                      "1:probe:raise", "--on-peer-failure", "wait", "--dist-timeout", "4",
                      "--db", "j.db"],
        cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    events = journal_events(tmp_path / "j.db")
    assert not [e for e in events if isinstance(e.event, ev.Aborted)]
    kinds = {e.rank: e.event.error_kind for e in events if isinstance(e.event, ev.Error)}
    assert kinds[0] == "collective-timeout"


def test_a_rank_killed_while_serving_is_announced_by_the_launcher(tmp_path: Path) -> None:
    """SIGKILL leaves a rank no chance to announce anything: the launcher, seeing its process
    end, announces it; the peer journals `aborted` naming the killed rank, and /liveness
    turns 503."""
    with serve(tmp_path, "--num-ranks", "2", "--linger", "1") as served:
        served.wait_for_health(200, within=240)
        pids = {
            e.rank: e.event.pid  # type: ignore[attr-defined]
            for e in journal_events(served.db)
            if e.kind == "run_started"
        }
        os.kill(pids[1], signal.SIGKILL)
        served.wait_for("/liveness", 503, within=10)
        assert served.proc.wait(timeout=120) == 1
    aborted = [e for e in journal_events(tmp_path / "j.db") if isinstance(e.event, ev.Aborted)]
    assert [(e.rank, e.event.failed_rank, e.event.announced_by) for e in aborted] == [
        (0, 1, "launcher")
    ]
    assert "killed by SIGKILL" in aborted[0].event.message
