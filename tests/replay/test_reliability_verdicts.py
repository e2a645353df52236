"""Verdicts on hand-built journals: running or hung, stopped or failed, dead or alive."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lifecycle.core.format.events import (
    Error,
    Event,
    Heartbeat,
    RunStarted,
    Transition,
)
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder, a2a, beat
from tests.conftest import run_cli
from tests.replay.scenarios import hung_then_stopped, signalled, walked_to_ready, warming
from tests.support.interpreter import run_python


def diagnose(db: Path, *now: str) -> tuple[int, dict[str, Any]]:
    args = ["diagnose", "latest", str(db), "--json", *now]
    result = run_cli("replay", args, cwd=db.parent, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_a_short_wait_in_a_collective_is_running_and_a_long_one_hung(tmp_path: Path) -> None:
    """Rank 0 waits in ulysses0 #4, which rank 1 has not entered: after 1 s (one heartbeat
    interval) the startup is `running`, exit 3; after 30 s it is `hung`, rank 1, exit 1."""
    for waited, expected in ((1.0, (3, "running", [])), (30.0, (1, "hung", [1]))):
        db = tmp_path / f"waited-{waited:g}.db"
        b = JournalBuilder(db)
        warming(b)
        b.rank(0).add(2.0, a2a("ulysses0", 4))
        t = 2.0
        while t < 2.0 + waited:
            t += 0.5
            b.rank(0).add(t, beat(a2a("ulysses0", 4)))
            b.rank(1).add(t, beat())
        b.close()
        status, doc = diagnose(db, *AS_WRITTEN)
        assert (status, doc["outcome"], doc["culprit_ranks"]) == expected, doc["summary"]


def test_a_startup_stopped_while_hung_is_still_hung(tmp_path: Path) -> None:
    """Rank 0 waited 20 s in a collective rank 1 never entered, then both were stopped by
    SIGTERM: `hung`, rank 1, not `stopped`."""
    db = tmp_path / "j.db"
    b = JournalBuilder(db)
    hung_then_stopped(b)
    b.close()
    status, doc = diagnose(db, *AS_WRITTEN)
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (1, "hung", [1]), doc["summary"]


def test_a_collective_broken_by_the_stop_itself_is_no_failure(tmp_path: Path) -> None:
    """Rank 0 is stopped by SIGTERM in a collective and leaves; rank 1's side of it breaks a
    moment later, then rank 1 is stopped too: `stopped`, no culprit, exit 3."""
    db = tmp_path / "j.db"
    b = JournalBuilder(db)
    warming(b)
    for rank in (0, 1):
        b.rank(rank).add(1.0, a2a("ulysses0", 0))
    b.rank(0).add(1.2, signalled())
    broken = Error(
        error_type="CollectiveError",
        error_kind="peer-gone",
        message="all_to_all #0 in group ulysses0 failed: Connection closed by peer",
        traceback="",
        trigger=None,
        fatal=True,
    )
    b.rank(1).add(1.21, broken)
    b.rank(1).walk(1.22, "failed")
    b.rank(1).add(1.5, signalled())
    b.close()
    status, doc = diagnose(db, *AS_WRITTEN)
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (3, "stopped", []), doc["summary"]
    assert [r["status"] for r in doc["ranks"]] == ["stopped", "stopped"]


def test_a_rank_silent_after_ready_while_its_peer_heartbeats_crashed(tmp_path: Path) -> None:
    """Both ranks ready; rank 1 writes nothing more (no shutdown) while rank 0 heartbeats on:
    `crashed`, rank 1, in ready."""
    db = tmp_path / "j.db"
    b = JournalBuilder(db)
    for rank in (0, 1):
        walked_to_ready(b.rank(rank))
    for t in range(2, 10):
        b.rank(0).add(t, beat())
    b.close()
    status, doc = diagnose(db, *AS_WRITTEN)
    assert (status, doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        1, "crashed", [1], "ready"
    ), doc["summary"]  # fmt: skip


def write_live_journal(db: Path, ranks: dict[int, tuple[str, int]], *, since: float) -> None:
    """A run of len(ranks) ranks, each (host, pid), warming up from `since` until now, with
    heartbeats to the end: what a journal being written looks like."""
    journal = Journal.open_for_write(str(db))
    run_id = "run-live"
    journal.create_run(
        RunRow(
            run_id=run_id,
            created_at=since,
            host="somewhere",
            world_size=len(ranks),
            config=args_to_json(ServerArgs(heartbeat_interval_s=5.0)),
            lifecycle_version="0.1.0",
        )
    )
    now = time.time()
    for rank, (host, pid) in ranks.items():
        writer = journal.writer(run_id=run_id, rank=rank)
        started = RunStarted(
            world_size=len(ranks), host=host, pid=pid, lifecycle_version="0.1.0",
            torch_version=None, python_version="3", device="cpu", dist_backend="gloo",
        )  # fmt: skip
        steps: list[tuple[float, Event, str]] = [
            (since, started, "created"),
            (since + 0.1, Transition(trigger="start", source="created", dest="gate-check"),
             "gate-check"),
            (since + 0.2, Transition(trigger="warm", source="gate-check", dest="bounded-warm"),
             "bounded-warm"),
            (now, Heartbeat(uptime_s=now - since, in_state_s=1.0, pending=None), "bounded-warm"),
        ]  # fmt: skip
        for wall, event, state in steps:
            writer.append(event, state=state, wall_time=wall, mono_ns=int(wall * 1e9))
        writer.close()
    journal.close()


def test_a_rank_whose_pid_now_belongs_to_a_later_process_is_crashed(tmp_path: Path) -> None:
    """Of three ranks recorded on this host as writing until now: one whose pid is held by a
    process started after the rank's first event (a reused pid) crashed; one whose pid is a
    process running since before is alive; one of another host is not judged by a pid here."""
    gone = run_python("import os; print(os.getpid())", check=True)
    since = time.time() - 60
    later = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        here = socket.gethostname()
        db = tmp_path / "j.db"
        write_live_journal(
            db, {0: (here, 1), 1: (here, later.pid), 2: ("another-host", int(gone.stdout))},
            since=since,
        )  # fmt: skip
        status, doc = diagnose(db)
    finally:
        later.communicate(timeout=30)
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (1, "crashed", [1]), doc["summary"]
    assert [r["status"] for r in doc["ranks"]] == ["running", "crashed", "running"]
