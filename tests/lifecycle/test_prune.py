"""Retention: `lifecycle db prune` removes whole old runs, and nothing a writer still needs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Table, create_engine

from lifecycle.core.errors import ConfigError
from lifecycle.store import Journal, RunRow, to_url
from lifecycle.store.backends.revisions import alembic_config
from lifecycle.store.backends.schema import events, metadata, runs
from lifecycle.store.learned.artifacts import ArtifactStore
from lifecycle.store.upkeep.prune import (
    ACTIVE_MARGIN_S,
    EVENTS_PER_TRANSACTION,
    RetentionPolicy,
    RunActivity,
    parse_duration,
    plan_prune,
)
from tests.conftest import (
    Completed,
    as_unprivileged,
    file_digest,
    one_clear_line,
    reaped,
    run_cli,
    wait_until,
)
from tests.support.artifacts import KEY

NOW = 1_900_000_000.0
DAY = 86_400.0
# One row of each type a journal column holds, for filling tables this test does not name.
_SAMPLE = {int: 0, float: 0.0, str: "", dict: {}, bool: False}


@dataclass(frozen=True)
class Run:
    run_id: str
    created_at: float
    ranks: int = 2
    events_per_rank: int = 3
    last_event_at: float | None = None  # the newest event's wall time; default: created_at
    config: dict[str, Any] | None = None  # default: the journal it is written into as its `db`


def aged(run_id: str, days: float, **more: Any) -> Run:
    """A run created `days` days before NOW."""
    return Run(run_id=run_id, created_at=NOW - days * DAY, **more)


def build_journal(db: Path, *runs_to_write: Run) -> Path:
    """A journal at `db`, at head, holding `runs_to_write`, with rows in every table keyed by
    run id."""
    with Journal.open_for_write(str(db)) as journal:
        for run in runs_to_write:
            journal.create_run(
                RunRow(run_id=run.run_id, created_at=run.created_at, host="h", world_size=run.ranks,
                       config={"db": str(db)} if run.config is None else run.config,
                       lifecycle_version="0.1.0")
            )  # fmt: skip
    with sqlite3.connect(db) as conn:
        for run in runs_to_write:
            last = run.created_at if run.last_event_at is None else run.last_event_at
            conn.executemany(
                "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state,"
                " data) VALUES (?, ?, ?, ?, ?, 'heartbeat', 1, 'ready', ?)",
                [
                    (run.run_id, rank, seq, last - (run.events_per_rank - 1 - seq) * 0.001, seq,
                     json.dumps({"uptime_s": 1.0, "in_state_s": 1.0, "pending": None}))
                    for rank in range(run.ranks)
                    for seq in range(run.events_per_rank)
                ],
            )  # fmt: skip
    engine = create_engine(to_url(str(db)))
    with engine.begin() as conn:
        for table in other_run_keyed_tables():
            for run in runs_to_write:
                for rank in range(run.ranks):
                    conn.execute(table.insert().values(sample_row(table, run.run_id, rank)))
    engine.dispose()
    settle(db)
    return db


def other_run_keyed_tables() -> list[Table]:
    """The tables keyed by run id besides `runs` and `events` (a per-rank summary, ...)."""
    return [t for t in metadata.sorted_tables if "run_id" in t.c and t not in (runs, events)]


def sample_row(table: Table, run_id: str, rank: int) -> dict[str, Any]:
    row = {column.name: _SAMPLE[column.type.python_type] for column in table.columns}
    return {**row, "run_id": run_id, **({"rank": rank} if "rank" in row else {})}


def settle(db: Path) -> None:
    """Fold the WAL into the file, so that its bytes change only when something writes."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def rows_by_table(db: Path) -> dict[str, dict[str, int]]:
    """Rows per run id in every table of the file that has a run_id column."""
    with sqlite3.connect(db) as conn:
        tables = [
            name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        ]
        counts = {}
        for name in tables:
            columns = [row[1] for row in conn.execute(f"PRAGMA table_info({name})")]
            if "run_id" in columns:
                query = f"SELECT run_id, count(*) FROM {name} GROUP BY run_id"
                counts[name] = dict(conn.execute(query).fetchall())
    return counts  # fmt: skip


def run_ids_in(db: Path) -> set[str]:
    return {run_id for table in rows_by_table(db).values() for run_id in table}


def prune(cli: Callable[..., Completed], db: Path, *args: str) -> Completed:
    return cli("db", "prune", "--db", str(db), *args, timeout=120)


def test_keep_runs_keeps_the_newest_and_removes_every_row_of_the_others(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--keep-runs 3 keeps the three newest runs (run id breaking a tie in created_at) and
    leaves no row of the others in any table keyed by run id."""
    db = build_journal(
        tmp_path / "j.db",
        aged("r1", 50),
        aged("r2", 40),
        aged("r3-a", 30),
        aged("r3-b", 30),
        aged("r4", 20, ranks=4),
    )
    before = rows_by_table(db)
    result = prune(lifecycle_cli, db, "--keep-runs", "3", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{db}: removed 2 runs (12 events) beyond the 3 newest; kept 3\n"
    after = rows_by_table(db)
    assert set(after) == set(before)
    assert len(after) >= 3  # runs, events, and a per-rank table keyed by run id
    for table, counts in before.items():
        assert after[table] == {k: v for k, v in counts.items() if k not in ("r1", "r2")}, table


def test_older_than_removes_the_runs_created_before_the_cutoff(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--older-than 30d removes the runs created more than 30 days before now, and says when
    the cutoff was."""
    db = build_journal(
        tmp_path / "j.db",
        aged("old-1", 40),
        aged("old-2", 31),
        aged("recent-1", 29),
        aged("recent-2", 1),
    )
    result = prune(lifecycle_cli, db, "--older-than", "30d", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    cutoff = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(NOW - 30 * DAY))
    assert result.stdout == f"{db}: removed 2 runs (12 events) older than {cutoff}; kept 2\n"
    assert run_ids_in(db) == {"recent-1", "recent-2"}


def test_with_both_options_only_runs_that_both_select_are_removed(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--keep-runs 1 --older-than 30d removes only the runs beyond the newest one that are
    also older than 30 days."""
    db = build_journal(
        tmp_path / "j.db", aged("a", 40), aged("b", 35), aged("c", 20), aged("d", 10)
    )
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--older-than", "30d", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert " removed 2 runs (12 events) beyond the 1 newest and older than " in result.stdout
    assert result.stdout.endswith("; kept 2\n")
    assert run_ids_in(db) == {"c", "d"}


def test_dry_run_says_what_would_go_and_writes_nothing(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--dry-run prints the same summary as `would remove`, and the file is byte for byte as
    it was."""
    db = build_journal(tmp_path / "j.db", aged("a", 40), aged("b", 35), aged("c", 20))
    digest = file_digest(db)
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--dry-run", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        f"{db}: would remove 2 runs (12 events) beyond the 1 newest; would keep 1\n"
    )
    assert file_digest(db) == digest
    assert run_ids_in(db) == {"a", "b", "c"}


def test_a_run_written_to_recently_is_skipped_and_counted(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """An old run with an event in the last ten minutes is still being written: it stays,
    and the summary says so."""
    db = build_journal(
        tmp_path / "j.db",
        aged("old", 40),
        aged("old-but-live", 39, last_event_at=NOW - 60),
        aged("new", 1),
    )
    result = prune(lifecycle_cli, db, "--older-than", "30d", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("; kept 1; skipped 1 still being written\n")
    assert " removed 1 run (6 events) " in result.stdout
    assert run_ids_in(db) == {"old-but-live", "new"}


def test_the_newest_run_is_never_removed(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--keep-runs 0 with --older-than that selects every run still keeps the newest run."""
    db = build_journal(tmp_path / "j.db", aged("a", 40), aged("b", 35))
    result = prune(lifecycle_cli, db, "--keep-runs", "0", "--older-than", "1d", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert run_ids_in(db) == {"b"}
    assert result.stdout.endswith("; kept 1\n")


def test_a_run_with_more_events_than_one_transaction_is_removed_whole(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A run with more events than one transaction deletes is removed over several, entirely,
    and the count of events is exact."""
    per_rank = EVENTS_PER_TRANSACTION + 1_234
    db = build_journal(
        tmp_path / "j.db",
        aged("big", 40, events_per_rank=per_rank),
        aged("small", 39),
        aged("new", 1),
    )
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert f" removed 2 runs ({2 * per_rank + 6:,} events) " in result.stdout
    assert run_ids_in(db) == {"new"}


APPENDER = """
import os, sys, time
from lifecycle.core.format.events import Heartbeat
from lifecycle.store import Journal, RunRow

db, stop, deadline = sys.argv[1], sys.argv[2], time.monotonic() + float(sys.argv[3])
journal = Journal.open_for_write(db)
journal.create_run(RunRow(run_id="live", created_at=time.time(), host="h", world_size=1,
                          config={}, lifecycle_version="0.1.0"))
writer = journal.writer(run_id="live", rank=0)
appended = 0
while not os.path.exists(stop) and time.monotonic() < deadline:
    writer.append(Heartbeat(uptime_s=1.0, in_state_s=1.0, pending=None), state="ready",
                  wall_time=time.time(), mono_ns=time.monotonic_ns())
    appended += 1
writer.close()
journal.close()
print(appended)
"""


@pytest.mark.usefixtures("no_leftover_processes")
def test_pruning_while_another_process_appends_to_another_run(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A process appending to a live run of the same file meets no error while old runs are
    pruned over many transactions, and every event it appended is there afterwards."""
    db = tmp_path / "j.db"
    now = time.time()
    build_journal(
        db,
        *(
            Run(run_id=f"old-{i:02}", created_at=now - (60 - i) * DAY, events_per_rank=1_500)
            for i in range(20)
        ),
        Run(
            run_id="old-big", created_at=now - 61 * DAY, events_per_rank=EVENTS_PER_TRANSACTION * 2
        ),
    )
    stop = tmp_path / "stop"
    appender = subprocess.Popen(
        [sys.executable, "-c", APPENDER, str(db), str(stop), "90"],
        cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    with reaped(appender):
        wait_until(lambda: live_events(db) >= 20, within=60, what="the appender is appending")
        result = prune(lifecycle_cli, db, "--older-than", "30d")
        stop.touch()
        out, err = appender.communicate(timeout=60)
    assert result.returncode == 0, result.stderr
    assert " removed 21 runs " in result.stdout
    assert appender.returncode == 0, err
    appended = int(out)
    assert appended > 0
    with sqlite3.connect(db) as conn:
        seqs = [
            seq
            for (seq,) in conn.execute("SELECT seq FROM events WHERE run_id = 'live' ORDER BY seq")
        ]
    assert seqs == list(range(appended))  # fmt: skip
    assert run_ids_in(db) == {"live"}


def live_events(db: Path) -> int:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            (count,) = conn.execute("SELECT count(*) FROM events WHERE run_id = 'live'").fetchone()
    except sqlite3.Error:
        return 0
    return int(count)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--older-than", "3x"), "argument --older-than: '3x' is not a duration such as 30d"),
        (("--older-than", "30"), "argument --older-than: '30' is not a duration such as 30d"),
        (("--older-than=-5d",), "argument --older-than: '-5d' is not a duration such as 30d"),
        (("--older-than", "0d"), "argument --older-than: '0d': a duration must be more than 0"),
        (("--keep-runs", "-1"), "argument --keep-runs: '-1' is not a number of runs (0 or more)"),
        (("--keep-runs", "two"), "argument --keep-runs: 'two' is not a number of runs"),
        ((), "give --keep-runs N, --older-than DURATION, or both"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], args: tuple[str, ...], message: str
) -> None:
    """A bad duration, a bad count, or neither option: one line on stderr, exit 2, the journal
    unchanged."""
    db = tmp_path / "j.db"
    build_journal(db, aged("a", 40), aged("b", 0))
    digest = file_digest(db)
    result = prune(lifecycle_cli, db, *args)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert message in result.stderr
    assert file_digest(db) == digest


def test_a_missing_journal_is_refused_and_not_created(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A journal that does not exist is one line and exit 2, and no file is left behind."""
    result = prune(lifecycle_cli, tmp_path / "missing.db", "--keep-runs", "1")
    assert result.returncode == 2
    assert result.stderr == f"lifecycle: error: {tmp_path / 'missing.db'}: no such journal\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [b"", b"not a database\n"])
def test_a_file_that_is_not_a_journal_is_refused_unchanged(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], content: bytes
) -> None:
    """An empty file or another program's file is one line and exit 2, left as it was."""
    path = tmp_path / "other.db"
    path.write_bytes(content)
    result = prune(lifecycle_cli, path, "--keep-runs", "1")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "not a lifecycle journal" in result.stderr
    assert path.read_bytes() == content


def test_an_older_journal_is_refused_until_upgraded(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A journal at an older revision is refused in one line that names the upgrade command,
    and left unchanged."""
    db = tmp_path / "old.db"
    command.upgrade(alembic_config(to_url(str(db))), "0002")
    settle(db)
    digest = file_digest(db)
    result = prune(lifecycle_cli, db, "--keep-runs", "1")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "lifecycle db upgrade" in result.stderr
    assert file_digest(db) == digest


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("45s", 45.0), ("90m", 5_400.0), ("12h", 43_200.0), ("30d", 2_592_000.0), ("2w", 1_209_600.0)],
)
def test_durations_are_read_in_their_unit(text: str, seconds: float) -> None:
    """Each unit of a duration means what it says."""
    assert parse_duration(text) == seconds


def test_a_duration_past_a_century_is_refused() -> None:
    """A duration too long to name a date is refused, not overflowed."""
    with pytest.raises(ConfigError, match="at most 100 years"):
        parse_duration("99999999999w")


_activity = st.lists(
    st.builds(
        RunActivity,
        run_id=st.text(alphabet="abcdef", min_size=1, max_size=4),
        created_at=st.floats(min_value=0, max_value=NOW),
        last_wall=st.none() | st.floats(min_value=0, max_value=NOW),
        events=st.integers(min_value=0, max_value=10),
    ),
    max_size=30,
    unique_by=lambda run: run.run_id,
)


@given(
    activity=_activity,
    keep_runs=st.none() | st.integers(min_value=0, max_value=40),
    older_than_s=st.none() | st.floats(min_value=1, max_value=NOW),
)
def test_a_plan_never_removes_the_newest_a_kept_or_a_live_run(
    activity: list[RunActivity], keep_runs: int | None, older_than_s: float | None
) -> None:
    """Whatever the runs and the policy, the plan removes neither the newest run, nor one of
    the `keep_runs` newest, nor one created after the cutoff, nor one written to recently."""
    if keep_runs is None and older_than_s is None:
        return
    policy = RetentionPolicy(keep_runs=keep_runs, older_than_s=older_than_s)
    plan = plan_prune(activity, policy, now=NOW)
    newest_first = sorted(activity, key=lambda run: (run.created_at, run.run_id), reverse=True)
    protected = newest_first[: max(keep_runs or 0, 1)]
    for run in plan.remove:
        assert run not in protected
        assert older_than_s is None or run.created_at < NOW - older_than_s
        assert max(run.created_at, run.last_wall or 0.0) <= NOW - ACTIVE_MARGIN_S
    assert len(plan.remove) + plan.kept + plan.skipped_active == len(activity)


def test_a_journal_with_a_corrupt_page_is_one_line_and_exit_2(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A journal whose events table has a page of garbage (a disk that lost it): one line that
    says the database is corrupt, exit 2, no traceback."""
    from tests.lifecycle.test_copy import corrupt_the_last_events_page

    db = build_journal(tmp_path / "j.db", aged("a", 40, events_per_rank=400), aged("b", 1))
    corrupt_the_last_events_page(db)
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 2
    assert one_clear_line(result).startswith(
        f"lifecycle: error: {db}: not a lifecycle journal: corrupt database"
    )


# -- the compile artifacts' files beside the journal ---------------------------------------------

LONG_AGO = time.time() - 2 * DAY


def with_artifacts(db: Path, *kept: tuple[str, bytes]) -> list[Path]:
    """Artifacts kept in `db` by the runs named (each under a key of its own), their files
    dated two days back; the files."""
    with Journal.open_for_write(str(db)) as journal:
        store = ArtifactStore(journal.engine, journal.backend.url)
        for n, (run_id, data) in enumerate(kept):
            key = dataclasses.replace(KEY, fingerprint=f"{n:016x}")
            assert store.keep(key, data, run_id=run_id, signature=None) is None
    files = [Path(f"{db}.compile-cache") / hashlib.sha256(d).hexdigest() for _, d in kept]
    for path in files:
        os.utime(path, (LONG_AGO, LONG_AGO))
    settle(db)
    return files


def test_prune_removes_artifact_files_no_row_names_and_stale_temporary_files(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Files named like a digest that no row names, and temporary files a keep left, are
    removed once older than the margin; a file a row names, a newer one (a keep may be
    committing it) and anything not named like an artifact stay."""
    db = build_journal(tmp_path / "j.db", aged("a", 1))
    (named,) = with_artifacts(db, ("a", b"named"))
    folder = named.parent
    unnamed, fresh = folder / ("1" * 64), folder / ("2" * 64)
    stale_part, fresh_part, notes = folder / ".part-abc", folder / ".part-def", folder / "notes"
    for path in (unnamed, fresh, stale_part, fresh_part, notes):
        path.write_bytes(b"left over")
    for path in (unnamed, stale_part, notes):
        os.utime(path, (LONG_AGO, LONG_AGO))
    result = prune(lifecycle_cli, db, "--keep-runs", "5")
    assert result.returncode == 0, result.stderr
    assert "removed 2 compile artifact file(s) that no row names" in result.stdout, result.stdout
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [named.name, fresh.name, fresh_part.name, notes.name]
    )


def test_prune_meeting_a_directory_at_an_artifacts_name_says_so_in_its_line(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """An old run's artifact whose file is a directory: its rows go with the run, the prune
    says in its one line that the directory was left (no traceback), exit 0, and the other
    artifact's file is removed."""
    db = build_journal(tmp_path / "j.db", aged("old", 40), aged("new", 1))
    odd, plain = with_artifacts(db, ("old", b"odd"), ("old", b"plain"))
    odd.unlink()
    odd.mkdir()
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and len(result.stdout.splitlines()) == 1
    assert "removed 2 compile artifact(s) no kept run used" in result.stdout
    assert f"1 file(s) not removed ({odd}: a directory, not a regular file)" in result.stdout
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM compile_artifacts").fetchone() == (0,)
    assert odd.is_dir() and not plain.exists()
    again = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert again.returncode == 0, again.stderr
    assert f"({odd}: a directory, not a regular file)" in again.stdout, again.stdout


def test_prune_removes_a_fifo_or_a_link_no_row_names_without_opening_it(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A FIFO and a symbolic link at digest names no row names, old enough: both unlinked
    (neither opened, nor followed: the link's target stays), as a regular file would be."""
    db = build_journal(tmp_path / "j.db", aged("a", 1))
    (named,) = with_artifacts(db, ("a", b"named"))
    folder = named.parent
    fifo, link, target = folder / ("3" * 64), folder / ("4" * 64), tmp_path / "target"
    os.mkfifo(fifo)
    target.write_bytes(b"not ours")
    link.symlink_to(target)
    for path in (fifo, link):
        os.utime(path, (LONG_AGO, LONG_AGO), follow_symlinks=False)
    result = prune(lifecycle_cli, db, "--keep-runs", "5")
    assert result.returncode == 0, result.stderr
    assert "removed 2 compile artifact file(s) that no row names" in result.stdout, result.stdout
    assert sorted(p.name for p in folder.iterdir()) == [named.name]
    assert target.read_bytes() == b"not ours"


def test_prune_meeting_a_file_it_may_not_remove_says_so_and_a_later_prune_removes_it(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The artifacts' folder made read-only: the prune removes the old run and its artifact's
    row, says in one line that the file could not be removed, exit 0; once the folder is
    writable again, the next prune removes the file that no row names."""
    db = build_journal(tmp_path / "j.db", aged("old", 40), aged("new", 1))
    (old,) = with_artifacts(db, ("old", b"old"))
    old.parent.chmod(0o500)
    try:
        result = run_cli(
            "lifecycle", ["db", "prune", "--db", str(db), "--keep-runs", "1", "--now", str(NOW)],
            cwd=tmp_path, timeout=120, prefix=as_unprivileged(),
        )  # fmt: skip
    finally:
        old.parent.chmod(0o700)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and len(result.stdout.splitlines()) == 1
    assert f"1 file(s) not removed ({old}: Permission denied)" in result.stdout, result.stdout
    assert run_ids_in(db) == {"new"} and old.exists()
    again = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert again.returncode == 0, again.stderr
    assert "removed 1 compile artifact file(s) that no row names" in again.stdout
    assert not old.exists()
