"""`lifecycle db copy` between journals, SQLite files and PostgreSQL databases: rows kept as
their writer wrote them, a second copy adds nothing, a copy that cannot finish says how far it
got, and one that leaves rows out fails saying so."""

from __future__ import annotations

import hashlib
import json
import os
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.format.events import Compiled, Heartbeat
from lifecycle.store import Journal, RunRow
from lifecycle.store.learned.artifacts import ArtifactStore
from tests.conftest import Completed, one_clear_line, run_cli
from tests.replay.conftest import copy_journal
from tests.support.artifacts import KEY

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

# A kind a newer lifecycle writes and this one does not know.
NEWER_KIND = "gpu_telemetry"
EVENT_COLUMNS = (
    "run_id, rank, seq, wall_time, mono_ns, kind, version, state, data, group_name, group_seq, op"
)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node's journal: one real run of two ranks that got to ready."""
    db = tmp_path_factory.mktemp("node") / "node.db"
    booted = run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--num-ranks", "2", "--heartbeat-interval", "0.2",
         "--db", str(db), "--log-level", "error"],
        cwd=db.parent, timeout=240,
    )  # fmt: skip
    assert booted.returncode == 0, booted.stderr[-2000:]
    return db


@pytest.fixture
def with_newer_row(node: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the node's journal in which one row of rank 1, half-way, is of a kind this
    version does not know (as a newer lifecycle would write it); its summaries removed, so
    that replay folds it from its events. The file and the run id."""
    source = tmp_path / "source.db"
    copy_journal(node, source)
    with sqlite3.connect(source) as conn:
        ((run_id, count),) = conn.execute(
            "SELECT run_id, count(*) FROM events WHERE rank = 1 GROUP BY run_id"
        ).fetchall()
        conn.execute(
            "UPDATE events SET kind = ?, version = 3, data = ? WHERE run_id = ? AND rank = 1"
            " AND seq = ?",
            (NEWER_KIND, json.dumps({"sm_clock_mhz": 1980}), run_id, count // 2),
        )
        conn.execute("DELETE FROM rank_checkpoints")
        conn.execute("DELETE FROM rank_summaries")
    settle(source)
    return source, run_id


def settle(db: Path) -> None:
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def copy(cli: Callable[..., Completed], source: Path, destination: Path, *more: str) -> Completed:
    return cli("db", "copy", "--db", str(source), "--to", str(destination), *more, timeout=180)


def event_rows(db: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        return conn.execute(
            f"SELECT {EVENT_COLUMNS} FROM events ORDER BY run_id, rank, seq"
        ).fetchall()


def test_a_copy_keeps_every_row_as_the_source_holds_it_an_unknown_kind_included(
    with_newer_row: tuple[Path, str], tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Every row of the source, one of a kind this version does not know among them, is in the
    copy with the same seq, kind, version, payload, state and times."""
    source, _ = with_newer_row
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet)
    assert done.returncode == 0, done.stderr
    assert "1 row(s) among them that this version cannot read (copied as they are)" in done.stdout
    assert event_rows(fleet) == event_rows(source)
    assert NEWER_KIND in {row[5] for row in event_rows(fleet)}


def test_a_second_copy_adds_nothing_says_so_and_the_copy_verifies(
    with_newer_row: tuple[Path, str], tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """Copying the same source again writes no row and says every rank was already there;
    `replay verify` of the copy passes."""
    source, _ = with_newer_row
    fleet = tmp_path / "fleet.db"
    assert copy(lifecycle_cli, source, fleet).returncode == 0
    before = event_rows(fleet)
    again = copy(lifecycle_cli, source, fleet)
    assert again.returncode == 0, again.stderr
    assert again.stdout == (
        f"{source} -> {fleet}: copied 0 events of 0 rank(s) in 0 run(s);"
        " 2 rank(s) already there, left as they are\n"
    )
    assert event_rows(fleet) == before
    verified = run_cli("replay", ["verify", "--all", str(fleet)], cwd=tmp_path)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_replay_reads_the_copy_as_it_reads_the_source(
    with_newer_row: tuple[Path, str], tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The copy's summaries and fold checkpoints give the verdict that folding every event of
    the source gives."""
    source, run_id = with_newer_row
    fleet = tmp_path / "fleet.db"
    assert copy(lifecycle_cli, source, fleet).returncode == 0
    with sqlite3.connect(fleet) as conn:
        assert conn.execute("SELECT count(*) FROM rank_summaries").fetchone() == (2,)
        assert conn.execute("SELECT count(*) FROM rank_checkpoints").fetchone() == (2,)
    said = {
        str(db): run_cli("replay", ["diagnose", run_id, str(db), "--json"], cwd=tmp_path)
        for db in (source, fleet)
    }
    assert json.loads(said[str(fleet)].stdout) == json.loads(said[str(source)].stdout)
    assert said[str(fleet)].returncode == said[str(source)].returncode == 0


def test_a_rank_copied_part_way_is_completed_from_where_it_ends(
    node: Path, tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A copy of the node's file taken while rank 0 had written part of its events, then a
    copy of the whole file: rank 0 is completed, rank 1 left as it is, and the copy holds
    every row of the node."""
    early = tmp_path / "early.db"
    copy_journal(node, early)
    with sqlite3.connect(early) as conn:
        conn.execute("DELETE FROM events WHERE rank = 0 AND seq > 11")
    settle(early)
    fleet = tmp_path / "fleet.db"
    assert copy(lifecycle_cli, early, fleet).returncode == 0
    done = copy(lifecycle_cli, node, fleet)
    assert done.returncode == 0, done.stderr
    assert "of 1 rank(s) in 1 run(s) (1 of them completed from where" in done.stdout
    assert "; 1 rank(s) already there" in done.stdout
    assert event_rows(fleet) == event_rows(node)


def journal_of_runs(db: Path, *, runs: int, ranks: int = 2, events: int = 300) -> list[str]:
    """A journal of `runs` runs written through the store, each rank `events` heartbeats."""
    run_ids = [f"20260101-0000{i:02}-abcdef" for i in range(runs)]
    with Journal.open_for_write(str(db)) as journal:
        for number, run_id in enumerate(run_ids):
            created = 1_800_000_000.0 + number * 60
            journal.create_run(
                RunRow(run_id=run_id, created_at=created, host="node-1", world_size=ranks,
                       config={"db": str(db)}, lifecycle_version="0.1.0")
            )  # fmt: skip
            for rank in range(ranks):
                writer = journal.writer(run_id=run_id, rank=rank)
                beat = Heartbeat(uptime_s=1.0, in_state_s=1.0, pending=None)
                writer.append_batch([(beat, "ready", created + i * 0.01, i) for i in range(events)])
                writer.close()
    settle(db)
    return run_ids


def corrupt_the_last_events_page(db: Path) -> None:
    """Write garbage over the events table's last leaf page, which holds the rows written last
    (the last run's last rank), as a disk that lost a page leaves it."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        (page,) = conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'events' AND pagetype = 'leaf'"
            " ORDER BY path DESC LIMIT 1"
        ).fetchone()
    with db.open("r+b") as fh:
        fh.seek((page - 1) * page_size)
        fh.write(random.Random(23).randbytes(page_size))


def test_a_corrupt_page_stops_the_copy_in_one_line_that_says_what_was_copied(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A source with a corrupt page under its last run: exit 2, and the one line says the
    database is corrupt, the run the copy stopped at, and the events and runs it had copied,
    which the destination holds."""
    source = tmp_path / "node.db"
    run_ids = journal_of_runs(source, runs=5)
    corrupt_the_last_events_page(source)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_clear_line(done)
    assert line.startswith(f"lifecycle: error: {source}: not a lifecycle journal: corrupt database")
    with sqlite3.connect(fleet) as conn:
        (events,) = conn.execute("SELECT count(*) FROM events").fetchone()
        (ranks,) = conn.execute(
            "SELECT count(DISTINCT run_id || '/' || rank) FROM events"
        ).fetchone()
        (runs,) = conn.execute("SELECT count(DISTINCT run_id) FROM events").fetchone()
    assert events >= 4 * 2 * 300
    assert line.endswith(
        f"; the copy stopped at run {run_ids[-1]}, after copying {events:,} events of {ranks}"
        f" rank(s) in {runs} run(s) into {fleet}"
    )


@pytest.mark.parametrize(
    ("named", "says"),
    [
        ("20991231-235959-000000", "--run 20991231-235959-000000: {source} holds no such run"),
        ("..", "--run: '..' is not a run id"),
    ],
)
def test_a_run_the_source_does_not_hold_is_one_line_and_creates_no_journal(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], named: str, says: str
) -> None:
    """--run naming no run of the source, or not a run id at all: one line, exit 2, and no
    destination journal is created."""
    source = tmp_path / "node.db"
    journal_of_runs(source, runs=1, events=3)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet, "--run", named)
    assert done.returncode == 2
    assert one_clear_line(done).startswith(f"lifecycle: error: {says.format(source=source)}")
    assert done.stdout == ""
    assert not fleet.exists()


def test_every_name_of_the_source_is_refused_as_the_destination(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--to naming the source's -wal, -shm or -journal file, a link to it, the same file by
    another path or as a URL: one line, exit 2, nothing created, and the source reads as it
    did (a copy into its -wal was deleted by the source's next open)."""
    folder = tmp_path / "node"
    folder.mkdir()
    source = folder / "node.db"
    journal_of_runs(source, runs=1, events=3)
    settle(source)
    before = event_rows(source)
    (tmp_path / "link.db").symlink_to(source)
    (tmp_path / "hard.db").hardlink_to(source)
    names = {
        "wal": f"{source}-wal",
        "shm": f"{source}-shm",
        "rollback journal": f"{source}-journal",
        "symlink": str(tmp_path / "link.db"),
        "hard link": str(tmp_path / "hard.db"),
        "another path": str(folder / ".." / "node" / "node.db"),
        "relative path": "node/node.db",
        "URL": f"sqlite:///{source}",
    }
    for why, name in names.items():
        done = lifecycle_cli("db", "copy", "--db", str(source), "--to", name, timeout=120)
        assert done.returncode == 2, (why, done.stdout, done.stderr)
        assert "is the journal being copied" in one_clear_line(done), why
    assert not Path(f"{source}-journal").exists()
    assert event_rows(source) == before


# -- every direction, PostgreSQL included ---------------------------------------------------------

SIGNATURE = "5" * 64  # carried as it is: a copy never signs, nor checks a signature


def decoded(location: str) -> tuple[list[RunRow], list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """A journal's runs, its events as read back (run, rank, seq, kind, version, state and the
    decoded payload) and its artifacts (key, digest, signature, the run that used it)."""
    with Journal.open_for_read(location) as journal:
        runs = journal.runs()
        read = [
            (r.stored.run_id, r.stored.rank, r.stored.seq, r.kind, r.version, r.stored.state,
             r.stored.event)
            for run in runs
            for rank in journal.ranks(run.run_id)
            for r in journal.read_rows(run_id=run.run_id, rank=rank)
        ]  # fmt: skip
        store = ArtifactStore(journal.engine, journal.backend.url)
        artifacts = [
            (a.key, a.digest, a.signature, a.used_run, store.read(a)) for a in store.every()
        ]
    return runs, read, artifacts


@pytest.fixture
def node_with_artifact(node: Path, tmp_path: Path) -> tuple[Path, str]:
    """A copy of the node's journal with a compile artifact its run kept; its run id."""
    source = tmp_path / "node.db"
    copy_journal(node, source)
    with Journal.open_for_write(str(source)) as journal:
        (run,) = journal.runs()
        store = ArtifactStore(journal.engine, journal.backend.url)
        assert store.keep(KEY, b"artifact", run_id=run.run_id, signature=SIGNATURE) is None
    settle(source)
    return source, run.run_id


def test_a_copy_in_every_direction_holds_every_event_of_the_source(
    node_with_artifact: tuple[Path, str],
    tmp_path: Path,
    postgres: Any,
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """SQLite to SQLite, SQLite to PostgreSQL, PostgreSQL to SQLite and PostgreSQL to
    PostgreSQL: each copy exits 0 and reads back event for event as the source (runs, ranks,
    seq, kinds, versions, states and decoded payloads), its artifact carried with its
    signature as it is. (A copy out of PostgreSQL wrote nothing: its payloads arrived decoded.)"""
    source, _ = node_with_artifact
    expected = decoded(str(source))
    assert len(expected[1]) > 50 and expected[2][0][2] == SIGNATURE
    first_pg = postgres.create_database("copy_from_sqlite")
    second_pg = postgres.create_database("copy_from_postgres")
    steps = [
        (str(source), str(tmp_path / "fleet.db")),
        (str(source), first_pg),
        (first_pg, str(tmp_path / "from-pg.db")),
        (first_pg, second_pg),
    ]
    for origin, into in steps:
        done = lifecycle_cli("db", "copy", "--db", origin, "--to", into, timeout=180)
        assert done.returncode == 0, (origin, into, done.stdout, done.stderr)
        assert "1 compile artifact(s) carried" in done.stdout, done.stdout
        assert decoded(into) == expected, (origin, into)


def test_a_copy_that_leaves_rows_out_says_how_many_and_why_and_fails(
    node: Path, tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A source row whose payload is not text (a BLOB): the copy writes every other row, and
    exits 2 in one line saying how many rows it left out and why."""
    source = tmp_path / "node.db"
    copy_journal(node, source)
    with sqlite3.connect(source) as conn:
        ((run_id, last),) = conn.execute(
            "SELECT run_id, max(seq) FROM events WHERE rank = 1 GROUP BY run_id"
        ).fetchall()
        conn.execute(
            "UPDATE events SET data = ? WHERE run_id = ? AND rank = 1 AND seq = ?",
            (b"\x00\xff", run_id, last // 2),
        )
    settle(source)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet)
    assert done.returncode == 2, done.stdout + done.stderr
    line = one_clear_line(done)
    assert "1 malformed row(s) left out" in line and "payload is not JSON text" in line, line
    assert done.stdout == ""
    assert len(event_rows(fleet)) == len(event_rows(source)) - 1


def test_a_fifo_at_an_artifacts_name_costs_the_copy_that_artifact_only(
    node_with_artifact: tuple[Path, str], tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A FIFO where the source's artifact file belongs: the copy finishes (it waited forever
    for a writer), carries every event and says which artifact it left and why."""
    source, _ = node_with_artifact
    folder = Path(f"{source}.compile-cache")
    (path,) = list(folder.iterdir())
    path.unlink()
    os.mkfifo(path)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 compile artifact(s) not carried" in done.stdout and "a FIFO" in done.stdout
    assert event_rows(fleet) == event_rows(source)


def test_copying_a_run_that_only_loaded_an_artifact_carries_it(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`db copy --run R` of a run that loaded an artifact another run kept: the artifact is
    carried, marked as used by R, so that the fleet's `db prune` keeps it while it keeps R."""
    source = tmp_path / "node.db"
    first, second = journal_of_runs(source, runs=2, events=3)
    with Journal.open_for_write(str(source)) as journal:
        store = ArtifactStore(journal.engine, journal.backend.url)
        assert store.keep(KEY, b"artifact", run_id=first, signature=SIGNATURE) is None
        store.mark_used(KEY.key, run_id=second)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet, "--run", second)
    assert done.returncode == 0, done.stderr
    assert "1 compile artifact(s) carried" in done.stdout, done.stdout
    _, _, artifacts = decoded(str(fleet))
    assert artifacts == [(KEY.key, hashlib.sha256(b"artifact").hexdigest(), SIGNATURE,
                          second, b"artifact")]  # fmt: skip
    pruned = lifecycle_cli("db", "prune", "--db", str(fleet), "--keep-runs", "1", timeout=120)
    assert pruned.returncode == 0, pruned.stderr
    assert len(decoded(str(fleet))[2]) == 1


def test_a_run_that_loaded_an_artifact_a_later_run_loaded_too_still_carries_it(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The artifact's row names only the last run that loaded it: `db copy --run R` of an
    earlier run that loaded it (its journal says `hit`) carries it all the same, marked as
    used by R."""
    source = tmp_path / "node.db"
    first, second, third = journal_of_runs(source, runs=3, ranks=1, events=3)
    hit = Compiled(key=KEY.key, blocks=1, backend="inductor", mode="default", seconds=1.0,
                   cache="hit", reason=None, artifact_bytes=8)  # fmt: skip
    with Journal.open_for_write(str(source)) as journal:
        store = ArtifactStore(journal.engine, journal.backend.url)
        assert store.keep(KEY, b"artifact", run_id=first, signature=SIGNATURE) is None
        for run_id in (second, third):
            writer = journal.writer(run_id=run_id, rank=0, resume=True)
            writer.append_batch([(hit, "gate-check", 1_800_000_100.0, 3)])
            writer.close()
            store.mark_used(KEY.key, run_id=run_id)
    settle(source)
    fleet = tmp_path / "fleet.db"
    done = copy(lifecycle_cli, source, fleet, "--run", second)
    assert done.returncode == 0, done.stderr
    assert "1 compile artifact(s) carried" in done.stdout, done.stdout
    (carried,) = decoded(str(fleet))[2]
    assert carried == (KEY.key, hashlib.sha256(b"artifact").hexdigest(), SIGNATURE, second,
                       b"artifact")  # fmt: skip
