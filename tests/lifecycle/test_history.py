"""Deadlines learned from history: the rule (pure), the startup history each healthy rank keeps
in its journal and the lookup a startup makes at gate-check, its migration, and a real hang
held to a learned deadline."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from alembic import command

from lifecycle.core.decisions.deadlines import (
    MIN_RUNS,
    SAMPLE_RUNS,
    STALL_FACTOR,
    STALL_FLOOR_S,
    RankDurations,
    RunDurations,
    expect,
    runs_of,
)
from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    Event,
    Expectations,
    RunStarted,
    Transition,
)
from lifecycle.store import Journal, RankWriter, RunRow, head_revision, journal_revision, to_url
from lifecycle.store.backends.revisions import alembic_config
from lifecycle.store.learned.history import recent_history
from tests.conftest import Completed, make_newer_journal, one_clear_line, processes_in
from tests.support import T0

KEY = "0123456789abcdef/bounded"


def run_of(run_id: str, at: float, **seconds: float) -> RunDurations:
    return RunDurations(
        run_id=run_id,
        ready_wall=at,
        process_ready_s=None,
        durations=tuple((state.replace("_", "-"), s) for state, s in seconds.items()),
    )


def test_no_deadline_is_learned_from_fewer_runs_than_the_minimum() -> None:
    """With one run too few, the expectations carry no state: the fixed deadline applies."""
    runs = [run_of(f"r{i}", T0 + i, gate_check=1.0) for i in range(MIN_RUNS - 1)]
    assert expect(KEY, runs) == Expectations(key=KEY, runs=MIN_RUNS - 1, states=())


def test_a_learned_deadline_is_the_factor_times_p95_or_the_floor() -> None:
    """A slow state's deadline is STALL_FACTOR x its p95; a quick one's is the floor."""
    slow = [10.0, 11.0, 12.0, 13.0, 20.0]
    runs = [run_of(f"r{i}", T0 + i, gate_check=0.5, bounded_warm=slow[i]) for i in range(MIN_RUNS)]
    states = {s.state: s for s in expect(KEY, runs).states}
    assert states["bounded-warm"].median_s == 12.0
    assert states["bounded-warm"].p95_s == 20.0
    assert states["bounded-warm"].count == MIN_RUNS
    assert states["bounded-warm"].deadline_s == STALL_FACTOR * 20.0
    assert states["gate-check"].deadline_s == STALL_FLOOR_S


def test_a_run_counts_each_state_at_its_slowest_rank() -> None:
    """A run's ranks make one run of the history, each state at its slowest rank, ready when
    its last rank was."""
    rows = [
        RankDurations(run_id="r", rank=rank, key=KEY, ready_wall=T0 + rank,
                      process_ready_s=3.0 + rank, durations=(("gate-check", 1.0 + rank),
                                                             ("bounded-warm", 5.0 - rank)))
        for rank in (0, 1)
    ]  # fmt: skip
    (run,) = runs_of(rows)
    assert run.durations == (("gate-check", 2.0), ("bounded-warm", 5.0))
    assert (run.ready_wall, run.process_ready_s) == (T0 + 1, 4.0)


def test_only_the_newest_runs_are_learned_from() -> None:
    """Of more runs than SAMPLE_RUNS, the oldest are left out: a machine that got faster is
    followed."""
    old = [run_of(f"old{i}", T0 + i, probe=100.0) for i in range(MIN_RUNS)]
    new = [run_of(f"new{i}", T0 + 1000 + i, probe=1.0) for i in range(SAMPLE_RUNS)]
    (probe,) = expect(KEY, [*old, *new]).states
    assert (probe.p95_s, probe.count) == (1.0, SAMPLE_RUNS)


# -- the history in the journal ------------------------------------------------------------------


def started() -> RunStarted:
    return RunStarted(world_size=1, host="h", pid=1, lifecycle_version="t", torch_version="t",
                      python_version="t", device="cpu", dist_backend=None,
                      process_started_wall=T0 - 4.0)  # fmt: skip


def startup(writer: RankWriter, at: float, spent: dict[str, float], *, ready: bool = True) -> float:
    """Append a startup through `spent`'s states (seconds each, `created` first) and, with
    `ready`, its ready action; the wall time it ends at."""
    states = list(spent)
    items: list[tuple[Event, str, float]] = [(started(), states[0], at)]
    source = states[0]
    for index, dest in enumerate([*states[1:], "ready"] if ready else states[1:]):
        at += spent[states[index]]
        items.append((Transition(trigger="t", source=source, dest=dest), dest, at))
        if dest == "gate-check":
            items.append((Expectations(key=KEY, runs=0, states=()), dest, at))
        source = dest
    if ready:
        items.append((ActionStarted(action="mark-ready"), "ready", at))
        items.append((ActionFinished(action="mark-ready", duration_s=0.1, ok=True), "ready", at))
    for event, state, wall in items:
        writer.append(event, state=state, wall_time=wall, mono_ns=0)
    return at


def journal_with_run(db: Path, run_id: str = "run-a") -> Journal:
    journal = Journal.open_for_write(str(db))
    journal.create_run(RunRow(run_id=run_id, created_at=T0 - 5.0, host="h", world_size=1,
                              config={}, lifecycle_version="t"))  # fmt: skip
    return journal


def history_rows(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT run_id, rank, key, ready_wall, process_ready_s, durations FROM startup_history"
        ).fetchall()


SPENT = {"created": 0.5, "gate-check": 1.0, "bounded-warm": 2.0}


def test_a_rank_that_finishes_its_ready_action_keeps_its_state_durations(tmp_path: Path) -> None:
    """The append that finishes the ready action writes the rank's history row: the key it
    journaled at gate-check, when it entered ready, and each state's time before it."""
    journal = journal_with_run(tmp_path / "j.db")
    writer = journal.writer(run_id="run-a", rank=0)
    ready_at = startup(writer, T0, SPENT)
    writer.close()
    journal.close()
    ((run_id, rank, key, ready_wall, process_ready_s, durations),) = history_rows(tmp_path / "j.db")
    assert (run_id, rank, key, ready_wall) == ("run-a", 0, KEY, ready_at)
    assert process_ready_s == pytest.approx(ready_at - (T0 - 4.0))
    assert json.loads(durations) == pytest.approx(SPENT)


def test_a_rank_that_never_gets_ready_keeps_no_history(tmp_path: Path) -> None:
    """A startup that stops before its ready action leaves the history as it was."""
    journal = journal_with_run(tmp_path / "j.db")
    writer = journal.writer(run_id="run-a", rank=0)
    startup(writer, T0, SPENT, ready=False)
    writer.close()
    journal.close()
    assert history_rows(tmp_path / "j.db") == []


def test_the_lookup_reads_the_newest_runs_of_its_key_through_its_index(tmp_path: Path) -> None:
    """A startup's lookup finds its key's rows newest first, and SQLite plans it on the
    (key, ready_wall) index: no scan of the history, however long."""
    db = tmp_path / "j.db"
    journal = Journal.open_for_write(str(db))
    for index in range(3):
        run_id = f"run-{index}"
        journal.create_run(RunRow(run_id=run_id, created_at=T0 + 100 * index, host="h",
                                  world_size=1, config={}, lifecycle_version="t"))  # fmt: skip
        writer = journal.writer(run_id=run_id, rank=0)
        startup(writer, T0 + 100 * index, SPENT)
        writer.close()
    with journal.engine.connect() as conn:
        found = recent_history(conn, KEY, ranks=1)
        plan = conn.exec_driver_sql(
            "EXPLAIN QUERY PLAN SELECT durations FROM startup_history WHERE key = ?"
            " ORDER BY ready_wall DESC LIMIT 64",
            (KEY,),
        ).fetchall()
    journal.close()
    assert [r.run_id for r in found.rows] == ["run-2", "run-1", "run-0"]
    assert "ix_startup_history_key_ready_wall" in str(plan)
    assert "SCAN startup_history" not in str(plan).replace("USING INDEX", "")


def beat_and_read(location: str) -> tuple[float, list[Any], int, int]:
    """A ready rank beats in place 30 s after its ready, then journals an event: when it got
    ready, its summary's heartbeat after the beat and after the event, and its event counts
    before the beat and after the event."""
    journal = Journal.open_for_write(location)
    journal.create_run(RunRow(run_id="run-b", created_at=T0, host="h", world_size=1,
                              config={}, lifecycle_version="t"))  # fmt: skip
    writer = journal.writer(run_id="run-b", rank=0)
    at = startup(writer, T0, SPENT)
    before = writer.next_seq
    writer.beat(at + 30.0)
    seen = [s.last_heartbeat_wall for s in journal.summaries(["run-b"])]
    writer.append(ActionStarted(action="later"), state="ready", wall_time=at + 31.0, mono_ns=0)
    seen += [s.last_heartbeat_wall for s in journal.summaries(["run-b"])]
    after = writer.next_seq
    writer.close()
    journal.close()
    return at, seen, before, after


def test_a_heartbeat_in_place_moves_only_the_summary_row(tmp_path: Path) -> None:
    """A beat kept in place journals no event; the summary row holds it, and an event appended
    after it does not take it back to the last heartbeat journaled."""
    ready_at, seen, before, after = beat_and_read(str(tmp_path / "j.db"))
    assert seen == [ready_at + 30.0, ready_at + 30.0]
    assert after == before + 1


def test_a_heartbeat_in_place_on_postgresql(postgres: Any) -> None:
    """The same on a PostgreSQL journal."""
    ready_at, seen, before, after = beat_and_read(postgres.create_database("history_beat"))
    assert seen == [ready_at + 30.0, ready_at + 30.0]
    assert after == before + 1


# -- migration -----------------------------------------------------------------------------------


def test_a_journal_at_0003_upgrades_and_keeps_the_history_from_then_on(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`lifecycle db upgrade` takes a journal at 0003 to head; a startup that reaches ready
    after that keeps its history row, and `replay history` reads it."""
    db = tmp_path / "old.db"
    command.upgrade(alembic_config(to_url(str(db))), "0003")
    result = lifecycle_cli("db", "upgrade", "--db", str(db), timeout=60)
    assert result.returncode == 0, result.stderr
    assert journal_revision(str(db)) == head_revision() == "0007"
    journal = journal_with_run(db)
    writer = journal.writer(run_id="run-a", rank=0)
    startup(writer, T0, SPENT)
    writer.close()
    journal.close()
    assert [row[:3] for row in history_rows(db)] == [("run-a", 0, KEY)]
    read = subprocess.run([sys.executable, "-m", "replay", "history", str(db), "--json"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert read.returncode == 0, read.stderr
    assert [h["key"] for h in json.loads(read.stdout)["histories"]] == [KEY]


def test_a_postgresql_journal_at_0003_upgrades(
    postgres: Any, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The same upgrade on PostgreSQL creates the history table and its index."""
    url = postgres.create_database("history_upgrade")
    command.upgrade(alembic_config(url.replace("postgresql://", "postgresql+psycopg://")), "0003")
    result = lifecycle_cli("db", "upgrade", "--db", url, timeout=60)
    assert result.returncode == 0, result.stderr
    assert journal_revision(url) == "0007"
    journal = Journal.open_for_read(url)
    try:
        with journal.engine.connect() as conn:
            indexes = conn.exec_driver_sql(
                "SELECT indexname FROM pg_indexes WHERE tablename = 'startup_history'"
            ).scalars()
            assert set(indexes) == {"pk_startup_history", "ix_startup_history_key_ready_wall"}
    finally:
        journal.close()


def test_a_journal_newer_than_head_is_still_refused(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A journal at a revision after head is one line and exit 2, for boot and for replay."""
    db = tmp_path / "new.db"
    make_newer_journal(db)
    booted = lifecycle_cli("boot", "--model", "micro-video", "--db", str(db), timeout=60)
    assert booted.returncode == 2
    assert "0999_future" in one_clear_line(booted)
    read = subprocess.run([sys.executable, "-m", "replay", "history", str(db)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert read.returncode == 2
    assert "0999_future" in read.stderr


# -- a real hang ---------------------------------------------------------------------------------

BOUNDED = {**os.environ, "PYTHONWARNINGS": "ignore", "LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1"}
BOOT = [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video", "--db", "j.db",
        "--log-level", "warning"]  # fmt: skip


def events_of(db: Path, kind: str) -> list[tuple[str, float, dict[str, Any]]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30) as conn:
        rows = conn.execute(
            "SELECT run_id, wall_time, data FROM events WHERE kind = ? ORDER BY wall_time", (kind,)
        ).fetchall()
    return [(run_id, wall, json.loads(data)) for run_id, wall, data in rows]


def test_a_silent_hang_is_stalled_at_its_learned_deadline(tmp_path: Path) -> None:
    """After enough healthy startups of the same fingerprint and path, a rank that hangs
    silently in bounded-warm is journaled `stalled` at that state's learned deadline, not
    after the fixed --state-deadline of 300 s."""
    db = tmp_path / "j.db"
    done = subprocess.run(BOOT, cwd=tmp_path, env=BOUNDED, capture_output=True, timeout=300,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # The history of MIN_RUNS healthy runs: the real one's row, and copies under other runs.
    with sqlite3.connect(db) as conn:
        (row,) = conn.execute("SELECT * FROM startup_history").fetchall()
        (run,) = conn.execute("SELECT * FROM runs").fetchall()
        for copy in range(1, MIN_RUNS):
            conn.execute("INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?, ?)",
                         (f"copy-{copy}", run[1] - copy, *run[2:]))  # fmt: skip
            conn.execute("INSERT INTO startup_history VALUES (?, ?, ?, ?, ?, ?)",
                         (f"copy-{copy}", 0, row[2], row[3] - copy, *row[4:]))  # fmt: skip
    proc = subprocess.Popen([*BOOT, "--fault", "0:bounded-warm:hang"], cwd=tmp_path, env=BOUNDED,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while not events_of(db, "stalled") and time.monotonic() < deadline:
            assert proc.poll() is None
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    ((_, stalled_at, stall),) = events_of(db, "stalled")
    expectations = [data for _, _, data in events_of(db, "expectations")]
    learned = {s["state"]: s for s in expectations[-1]["states"]}
    assert expectations[-1]["runs"] == MIN_RUNS
    assert stall["deadline_s"] == learned["bounded-warm"]["deadline_s"] < 300
    assert stall["in_state_s"] > stall["deadline_s"]
    ((_, hung_at, _),) = events_of(db, "fault_injected")
    assert stalled_at - hung_at < stall["deadline_s"] + 10
    assert processes_in(tmp_path) == []


def test_a_history_row_that_does_not_decode_never_stops_a_boot_or_replay_history(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A startup_history row whose durations nest deeper than JSON's parser recurses (or are
    not JSON) is left out with a warning: the next boot of its key gets to ready and `replay
    history` answers, exit 0, saying what it left out."""
    first = lifecycle_cli("boot", "--model", "micro-video", "--db", "j.db", "--warmup-mode", "none")
    assert first.returncode == 0, first.stderr[-2000:]
    db = tmp_path / "j.db"
    with sqlite3.connect(db) as conn:
        ((run_id,),) = conn.execute("SELECT run_id FROM startup_history").fetchall()
        conn.execute("UPDATE startup_history SET durations = ?", ("[" * 200_000 + "]" * 200_000,))
    again = lifecycle_cli("boot", "--model", "micro-video", "--db", "j.db", "--warmup-mode", "none")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "history_rows_skipped" in again.stderr
    history = subprocess.run(
        [sys.executable, "-m", "replay", "history", str(db)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert history.returncode == 0, history.stderr
    assert "Traceback" not in history.stderr
    (warning,) = history.stderr.strip().splitlines()
    assert f"1 startup history row(s) that do not decode left out (run {run_id} rank 0)" in warning


def test_a_components_load_in_the_history_is_never_a_state_with_a_deadline() -> None:
    """History rows hold each component's load beside the states' times: a startup learns no
    deadline from them, only the states'."""
    runs = [
        run_of(f"r{i}", T0 + i, gate_check=1.0, **{"load transformer": 2.0})
        for i in range(MIN_RUNS)
    ]
    expected = expect(KEY, runs)
    assert [s.state for s in expected.states] == ["gate-check"]
