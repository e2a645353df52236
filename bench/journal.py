"""Journal append cost: one durable append against raw SQLite, and appends from N processes."""

from __future__ import annotations

import itertools
import shutil
import socket
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.compare import compared_seconds
from bench.procs import Pool, serve
from bench.stats import Paired, interleave, median, percentile
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, format_ratio, verdict

RATIO_TARGET = 2.0
PROCESS_COUNTS = (1, 2, 4, 8)
TIMEOUT_S = 300.0  # for starting the workers, and for each round
RUN_ID = "bench-journal"
STATE = "bounded-warm"
INSERT = (
    "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state, data)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# An events row as INSERT takes it: run_id, rank, seq, wall_time, mono_ns, kind, version,
# state, data.
RawRow = tuple[str, int, int, float, int, str, int, str, str]


def new_journal(path: Path | str, *, run_id: str, world_size: int) -> None:
    """A journal (a file, or a database URL) made by the library's own migrations, with one
    run row."""
    from lifecycle import __version__
    from lifecycle.store.journal import Journal
    from lifecycle.store.rows import RunRow

    with Journal.open_for_write(str(path)) as journal:
        journal.create_run(
            RunRow(
                run_id=run_id,
                created_at=time.time(),
                host=socket.gethostname(),
                world_size=world_size,
                config={"benchmark": "journal"},
                lifecycle_version=__version__,
            )
        )


def raw_connection(path: Path) -> sqlite3.Connection:
    """The journal's connection settings, without the library: WAL, synchronous=NORMAL,
    foreign keys, the same busy timeout, autocommit so that BEGIN is ours."""
    from lifecycle.store.backends.sqlite import BUSY_TIMEOUT_S

    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    conn.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA foreign_keys=ON")
    return conn


# ---------------------------------------------------------------------------------------------
# One append


def interleaved_appends(
    lifecycle_journal: str,
    raw_insert: Callable[[RawRow], None],
    *,
    pairs: int,
    discard: int,
    fresh: bool = False,
) -> Paired:
    """Seconds per append of one action_started event: through the library into
    `lifecycle_journal` (side a), interleaved one by one with `raw_insert` of the same row,
    pre-encoded (side b)."""
    from lifecycle.core.format.codec import encode
    from lifecycle.core.format.events import ActionStarted
    from lifecycle.store.journal import Journal

    event = ActionStarted(action="bounded-warmup")
    payload = encode(event)
    raw_seq = itertools.count()
    if fresh:
        new_journal(lifecycle_journal, run_id=RUN_ID, world_size=1)
    journal = Journal.open_for_write(lifecycle_journal)
    writer = journal.writer(run_id=RUN_ID, rank=0)

    def through_lifecycle() -> float:
        started = time.perf_counter()
        writer.append(event, state=STATE, wall_time=time.time(), mono_ns=time.monotonic_ns())
        return time.perf_counter() - started

    def raw() -> float:
        started = time.perf_counter()
        raw_insert(
            (RUN_ID, 0, next(raw_seq), time.time(), time.monotonic_ns(), event.kind, 1, STATE,
             payload)
        )  # fmt: skip
        return time.perf_counter() - started

    try:
        return interleave(through_lifecycle, raw, pairs=pairs, discard=discard)
    finally:
        writer.close()
        journal.close()


def latency_compared(paired: Paired, *, figure: str, how: str) -> list[Row]:
    """The median and p99 rows of an `interleaved_appends`, the library against raw."""
    return [
        compared_seconds(
            figure=f"{figure}, {name}",
            value_s=pick(paired.a),
            baseline_s=pick(paired.b),
            target=verdict(
                f"<= {RATIO_TARGET:g}x raw", met=pick(paired.a) / pick(paired.b) <= RATIO_TARGET
            ),
            how=how,
        )
        for name, pick in (("median", median), ("p99", lambda s: percentile(s, 99)))
    ]


def latency_rows(settings: Settings) -> list[Row]:
    pairs = 300 if settings.quick else 4000
    discard = 30 if settings.quick else 200
    progress(f"journal: append latency, {pairs} interleaved pairs")
    lifecycle_db = settings.workdir / "append-lifecycle.db"
    raw_db = settings.workdir / "append-raw.db"
    new_journal(lifecycle_db, run_id=RUN_ID, world_size=1)
    new_journal(raw_db, run_id=RUN_ID, world_size=1)
    raw = raw_connection(raw_db)

    def raw_sqlite(row: RawRow) -> None:
        cur = raw.cursor()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(INSERT, row)
        cur.execute("COMMIT")
        cur.close()

    from lifecycle.store.summaries import SUMMARY_COLUMNS

    # The floor of what the journal's design writes per append: the event row and the rank's
    # summary row (what `replay` answers from without reading every event), in one commit.
    summary_db = settings.workdir / "append-raw-summary.db"
    new_journal(summary_db, run_id=RUN_ID, world_size=1)
    with_summary = raw_connection(summary_db)
    update = (
        "UPDATE rank_summaries SET "
        + ", ".join(f"{c} = ?" for c in SUMMARY_COLUMNS)
        + " WHERE run_id = ? AND rank = 0"
    )

    def summary_of(row: RawRow) -> tuple[object, ...]:
        return (row[2], row[2] + 1, STATE, row[3], row[3], row[3], "created " + STATE, None,
                None, False, False, True, False, None, "host")  # fmt: skip

    columns = ", ".join(("run_id", "rank", *SUMMARY_COLUMNS))
    marks = ", ".join("?" for _ in range(2 + len(SUMMARY_COLUMNS)))
    first: RawRow = (RUN_ID, 0, -1, 0.0, 0, "x", 1, STATE, "{}")
    with_summary.execute(
        f"INSERT INTO rank_summaries ({columns}) VALUES ({marks})", (RUN_ID, 0, *summary_of(first))
    )

    def raw_sqlite_with_summary(row: RawRow) -> None:
        cur = with_summary.cursor()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(INSERT, row)
        cur.execute(update, (*summary_of(row), RUN_ID))
        cur.execute("COMMIT")
        cur.close()

    try:
        paired = interleaved_appends(str(lifecycle_db), raw_sqlite, pairs=pairs, discard=discard)
        floor = interleaved_appends(
            str(settings.workdir / "append-lifecycle-2.db"), raw_sqlite_with_summary,
            pairs=pairs, discard=discard, fresh=True,
        )  # fmt: skip
    finally:
        raw.close()
        with_summary.close()
    how = (
        f"{pairs} appends each side, interleaved one by one ({discard} pairs discarded), on two"
        " files in the same directory made by the same migrations; lifecycle:"
        " RankWriter.append of an action_started event (JSON encoding included); raw: sqlite3"
        " BEGIN IMMEDIATE / INSERT of the same row, pre-encoded / COMMIT with WAL,"
        " synchronous=NORMAL, foreign_keys=ON"
    )
    floor_how = (
        f"the same {pairs} interleaved pairs against raw sqlite3 writing what the journal's"
        " design writes per append: BEGIN IMMEDIATE / INSERT of the event row / UPDATE of the"
        f" rank's summary row ({len(SUMMARY_COLUMNS)} columns, what `replay runs` and"
        " `/lifecycle` read instead of every event) / COMMIT; the ratio is the library's own"
        " cost above that floor (JSON encoding, the fold that computes the summary, the"
        " driver's statement handling)"
    )
    return [
        *latency_compared(paired, figure="journal append latency", how=how),
        compared_seconds(
            figure="journal append latency against raw with its summary row, median",
            value_s=median(floor.a),
            baseline_s=median(floor.b),
            target="the floor of the 2x target above",
            how=floor_how,
        ),
    ]


# ---------------------------------------------------------------------------------------------
# N processes


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """One round of appends from N processes: its rate, and its appends as counted by the
    workers and as read back from the journal files."""

    events_per_s: float
    appended: int
    read_back: int
    lock_errors: int
    other_errors: int


def _append_in_processes(
    settings: Settings,
    pool: Pool,
    template: Path,
    *,
    processes: int,
    shared: bool,
    events: int,
    tag: str,
) -> Throughput:
    from lifecycle.store.journal import Journal

    layout = "shared" if shared else "own"
    files = (
        [settings.workdir / f"procs-{tag}-{layout}.db"]
        if shared
        else [settings.workdir / f"procs-{tag}-{layout}-{i}.db" for i in range(processes)]
    )
    for path in files:
        shutil.copyfile(template, path)
    results = pool.round(
        [
            {"db": str(files[0] if shared else files[i]), "rank": i, "events": events}
            for i in range(processes)
        ]
    )
    read_back = 0
    for path in files:
        with Journal.open_for_read(str(path)) as journal:
            read_back += sum(1 for _ in journal.read(run_id=RUN_ID))
    appended = sum(int(r["appended"]) for r in results)
    span = max(float(r["finished"]) for r in results) - min(float(r["started"]) for r in results)
    return Throughput(
        events_per_s=appended / span if span > 0 else 0.0,
        appended=appended,
        read_back=read_back,
        lock_errors=sum(int(r["lock_errors"]) for r in results),
        other_errors=sum(int(r["other_errors"]) for r in results),
    )


def throughput_rows(settings: Settings) -> list[Row]:
    events = 300 if settings.quick else 2000
    repeats = 1 if settings.quick else 3
    rows = []
    # Every journal of a round is a copy of one made by the migrations, with its run row.
    template = settings.workdir / "procs-template.db"
    new_journal(template, run_id=RUN_ID, world_size=max(PROCESS_COUNTS))
    progress(f"journal: starting {max(PROCESS_COUNTS)} worker processes")
    with Pool(
        "bench.journal", size=max(PROCESS_COUNTS), workdir=settings.workdir, timeout_s=TIMEOUT_S
    ) as pool:
        for processes in PROCESS_COUNTS:
            progress(f"journal: {processes} process(es) x {events} appends, {repeats} pair(s)")
            shared: list[Throughput] = []
            own: list[Throughput] = []
            for repeat in range(repeats):
                order = (True, False) if repeat % 2 == 0 else (False, True)
                for is_shared in order:
                    result = _append_in_processes(
                        settings,
                        pool,
                        template,
                        processes=processes,
                        shared=is_shared,
                        events=events,
                        tag=f"{processes}-{repeat}",
                    )
                    (shared if is_shared else own).append(result)
            rows.append(_throughput_row(processes, events, repeats, shared, own))
    return rows


def _throughput_row(
    processes: int, events: int, repeats: int, shared: list[Throughput], own: list[Throughput]
) -> Row:
    every = (*shared, *own)
    lost = sum(t.appended - t.read_back for t in every)
    locks = sum(t.lock_errors for t in every)
    others = sum(t.other_errors for t in every)
    one_file = median([t.events_per_s for t in shared])
    each_file = median([t.events_per_s for t in own])
    return Row(
        figure=f"journal append throughput, {processes} process(es)",
        value=f"{one_file:,.0f} events/s (one file)",
        baseline=f"{each_file:,.0f} events/s (a file each)",
        ratio=format_ratio(one_file / each_file),
        target=verdict(
            f"0 lost, 0 lock errors (lost {lost}, lock errors {locks}, other errors {others})",
            met=lost == 0 and locks == 0 and others == 0,
        ),
        how=(
            f"{processes} worker process(es) x {events} durable appends (RankWriter.append, one"
            " rank each), released together; events/s = all appended / (last finish - first"
            f" start); median of {repeats} interleaved one-file / file-each pair(s);"
            " lost = appended - read back"
        ),
    )


def measure(settings: Settings) -> list[Row]:
    return [*latency_rows(settings), *throughput_rows(settings)]


BENCHMARK = Benchmark(name="journal", measure=measure)


# ---------------------------------------------------------------------------------------------
# The worker process


def append_task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """Open the journal as rank `rank`; once released, append `events` events and count the
    appends that failed, and why."""
    from lifecycle.core.errors import JournalError
    from lifecycle.core.format.events import ActionStarted
    from lifecycle.store.journal import Journal

    journal = Journal.open_for_write(str(payload["db"]))
    writer = journal.writer(run_id=RUN_ID, rank=int(payload["rank"]))
    event = ActionStarted(action="bounded-warmup")
    total = int(payload["events"])

    def work() -> dict[str, Any]:
        appended = lock_errors = other_errors = 0
        started = time.monotonic()
        for _ in range(total):
            try:
                writer.append(
                    event, state=STATE, wall_time=time.time(), mono_ns=time.monotonic_ns()
                )
                appended += 1
            except JournalError as exc:
                if "locked" in str(exc) or "busy" in str(exc):
                    lock_errors += 1
                else:
                    other_errors += 1
        finished = time.monotonic()
        writer.close()
        journal.close()
        return {
            "appended": appended,
            "lock_errors": lock_errors,
            "other_errors": other_errors,
            "started": started,
            "finished": finished,
        }

    return work


if __name__ == "__main__":
    from lifecycle.store.backends.revisions import known_revisions

    known_revisions()  # import SQLAlchemy and Alembic before saying ready
    serve(append_task)
