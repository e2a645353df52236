"""Retention: removing whole old runs from a journal, in short transactions."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Delete, Engine, Table, delete, func, inspect, select

from lifecycle.core.errors import ConfigError
from lifecycle.store.backends.dberrors import DATABASE_ERRORS, is_retryable, journal_error
from lifecycle.store.backends.schema import events, metadata, runs
from lifecycle.store.journal import Journal
from lifecycle.store.keeperlog import prune_keeper_rows
from lifecycle.store.learned.artifacts import ArtifactStore, prune_artifacts
from lifecycle.store.upkeep.dumps import ThisJournal, find_dumps, remove_dumps

# A run with an event (or created) this recently may still be written: never removed.
ACTIVE_MARGIN_S = 600.0
# Each transaction holds SQLite's one write lock: bounded so that a rank appending to another
# run of the same file waits milliseconds, not the length of the whole prune.
RUNS_PER_TRANSACTION = 200
EVENTS_PER_TRANSACTION = 5_000
# Between two transactions the lock is left free at least as long as it was held (and never
# less than this), so that writers polling in SQLite's busy handler get their turn.
MIN_PAUSE_S = 0.02
LOCKED_RETRIES = 5
MAX_DURATION_S = 100 * 365 * 86_400.0

_DURATION = re.compile(r"(?P<count>[0-9]{1,12})(?P<unit>[smhdw])")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3_600.0, "d": 86_400.0, "w": 604_800.0}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as `30d`, `12h`, `90m`, `45s` or `2w`; ConfigError otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise ConfigError(
            f"{text!r} is not a duration such as 30d, 12h, 90m, 45s or 2w", field="older_than"
        )
    seconds = int(match["count"]) * _UNIT_S[match["unit"]]
    if not 0 < seconds <= MAX_DURATION_S:
        raise ConfigError(
            f"{text!r}: a duration must be more than 0 and at most 100 years", field="older_than"
        )
    return seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class RetentionPolicy:
    """Which runs to remove: those beyond the `keep_runs` newest, those created more than
    `older_than_s` ago, or (both given) only the runs that both select."""

    keep_runs: int | None = None
    older_than_s: float | None = None
    active_margin_s: float = ACTIVE_MARGIN_S

    def __post_init__(self) -> None:
        if self.keep_runs is None and self.older_than_s is None:
            raise ConfigError("give --keep-runs N, --older-than DURATION, or both")
        if self.keep_runs is not None and self.keep_runs < 0:
            raise ConfigError(f"--keep-runs {self.keep_runs} is negative", field="keep_runs")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunActivity:
    """What retention needs to know of one run."""

    run_id: str
    created_at: float
    last_wall: float | None  # its newest event's wall time; None without events
    events: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PrunePlan:
    remove: tuple[RunActivity, ...]
    kept: int
    kept_runs: tuple[RunActivity, ...] = ()
    skipped_active: int  # selected, but written to within the margin
    keep_runs: int | None
    cutoff: float | None  # runs created before this are old enough (seconds since the epoch)


@dataclass(frozen=True, slots=True, kw_only=True)
class PruneOutcome:
    plan: PrunePlan
    runs_removed: int
    events_removed: int
    dry_run: bool
    # The Flight Recorder dump files that the removed runs' ranks wrote on this host into this
    # journal's own dump folders (lifecycle.store.upkeep.dumps), and how many of them were removed.
    dump_files: tuple[Path, ...] = ()
    dumps_removed: int = 0
    # Compile artifacts that no run left in the journal stored or used, removed with the runs;
    # the files beside a SQLite journal that no row names (or a keep left half-written),
    # removed; and a line for each file that could not be (left for a later prune).
    artifacts_removed: int = 0
    artifact_files_removed: int = 0
    artifact_files_left: tuple[str, ...] = ()
    # The weight keepers' rows (keeper_log) older than every run kept, removed.
    keeper_rows_removed: int = 0


def plan_prune(
    activity: Sequence[RunActivity], policy: RetentionPolicy, *, now: float
) -> PrunePlan:
    """The runs to remove; never the newest run, nor one written to within the margin."""
    ordered = sorted(activity, key=lambda run: (run.created_at, run.run_id))
    cutoff = None if policy.older_than_s is None else now - policy.older_than_s
    candidates = ordered[:-1]  # the newest run is never removed, whatever the policy
    if policy.keep_runs is not None:
        candidates = ordered[: max(0, len(ordered) - max(policy.keep_runs, 1))]
    if cutoff is not None:
        candidates = [run for run in candidates if run.created_at < cutoff]
    active_since = now - policy.active_margin_s
    remove = tuple(run for run in candidates if _last_activity(run) <= active_since)
    removed = {run.run_id for run in remove}
    return PrunePlan(
        remove=remove,
        kept_runs=tuple(run for run in ordered if run.run_id not in removed),
        kept=len(ordered) - len(candidates),
        skipped_active=len(candidates) - len(remove),
        keep_runs=policy.keep_runs,
        cutoff=cutoff,
    )


def _last_activity(run: RunActivity) -> float:
    return run.created_at if run.last_wall is None else max(run.created_at, run.last_wall)


def format_outcome(outcome: PruneOutcome, location: str) -> str:
    """One line that says what was (or would be) removed, kept and skipped."""
    plan = outcome.plan
    why = []
    if plan.keep_runs is not None:
        why.append(f"beyond the {plan.keep_runs} newest")
    if plan.cutoff is not None:
        why.append("older than " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(plan.cutoff)))
    runs_word = "run" if outcome.runs_removed == 1 else "runs"
    events_word = "event" if outcome.events_removed == 1 else "events"
    verb, kept = ("would remove", "would keep") if outcome.dry_run else ("removed", "kept")
    dumps = len(outcome.dump_files) if outcome.dry_run else outcome.dumps_removed
    line = (
        f"{location}: {verb} {outcome.runs_removed} {runs_word}"
        f" ({outcome.events_removed:,} {events_word}"
        + (f", {dumps} Flight Recorder dump file(s)" if dumps else "")
        + f") {' and '.join(why)}; {kept} {plan.kept}"
    )
    if outcome.artifacts_removed:
        line += f"; removed {outcome.artifacts_removed} compile artifact(s) no kept run used"
    if outcome.artifact_files_removed:
        line += (
            f"; removed {outcome.artifact_files_removed} compile artifact file(s) that no row names"
        )
    if outcome.artifact_files_left:
        left = outcome.artifact_files_left
        line += f"; {len(left)} file(s) not removed ({left[0]})"
    if outcome.keeper_rows_removed:
        line += f"; removed {outcome.keeper_rows_removed} keeper row(s) older than every run kept"
    if plan.skipped_active:
        line += f"; skipped {plan.skipped_active} still being written"
    return line


def open_for_pruning(location: str) -> Journal:
    """The journal at `location` opened for writing; refused where there is none, which
    opening for writing alone would create."""
    Journal.open_for_read(location).close()
    return Journal.open_for_write(location)


def prune(
    journal: Journal,
    policy: RetentionPolicy,
    *,
    now: float,
    dry_run: bool = False,
    pause: Callable[[float], None] = time.sleep,
) -> PruneOutcome:
    """Remove the runs `policy` selects, whole: their rows in every table keyed by run id.

    Reading goes through a read-only engine, so deciding takes no write lock; each delete is
    a short transaction of its own. A prune stopped midway leaves a run with part of its
    events removed, and the next prune finishes it.
    """
    reader = journal.backend.read_engine()
    try:
        with reader.connect() as conn:
            plan = plan_prune(_activity(conn), policy, now=now)
            tables = _run_keyed_tables(conn)
            # Found before the rows that name them go.
            dumps = find_dumps(
                conn, [run.run_id for run in plan.remove], ThisJournal.at(journal.backend.url)
            )
        if dry_run:
            return PruneOutcome(
                plan=plan,
                runs_removed=len(plan.remove),
                events_removed=sum(run.events for run in plan.remove),
                dry_run=True,
                dump_files=tuple(dumps),
            )
        removal = _Removal(journal, reader, tables, pause)
        removal.remove(plan.remove)
    except DATABASE_ERRORS as exc:
        # Reading: a damaged page, or a server that went away after the journal opened.
        raise journal_error(exc, journal.location, opened=True) from None
    finally:
        reader.dispose()
    artifacts = _prune_artifacts(journal, before=now - ACTIVE_MARGIN_S)
    kept_since = min((r.created_at for r in plan.kept_runs), default=now - policy.active_margin_s)
    keeper_rows = prune_keeper_rows(journal, before=kept_since)
    if journal.engine.dialect.name == "sqlite" and plan.remove:
        _truncate_wal(journal)
    return PruneOutcome(
        plan=plan,
        runs_removed=removal.runs,
        events_removed=removal.events,
        dry_run=False,
        dump_files=tuple(dumps),
        dumps_removed=remove_dumps(dumps),
        artifacts_removed=artifacts.rows,
        artifact_files_removed=artifacts.files,
        artifact_files_left=artifacts.left,
        keeper_rows_removed=keeper_rows,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _ArtifactsPruned:
    rows: int
    files: int  # files no row named, removed
    left: tuple[str, ...]  # a line for each file that could not be removed


def _prune_artifacts(journal: Journal, *, before: float) -> _ArtifactsPruned:
    """Remove the compile artifacts no kept run stored or used, their files after the rows,
    then the files beside the journal no row names, last written before `before`. A file that
    cannot be removed is said and left: no row names it, so a later prune removes it."""
    store = ArtifactStore(journal.engine, journal.backend.url)
    try:
        with journal.engine.begin() as conn:
            removed, digests = prune_artifacts(conn)
        _, left = store.remove_files(digests)
        files, more = store.remove_unnamed_files(before=before)
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True, opened=True) from None
    return _ArtifactsPruned(rows=removed, files=files, left=tuple(dict.fromkeys(left + more)))


def _activity(conn: Connection) -> list[RunActivity]:
    stmt = (
        select(
            runs.c.run_id,
            runs.c.created_at,
            func.max(events.c.wall_time),
            func.count(events.c.seq),
        )
        .select_from(runs.outerjoin(events, events.c.run_id == runs.c.run_id))
        .group_by(runs.c.run_id, runs.c.created_at)
    )
    found = []
    for run_id, created_at, last_wall, count in conn.execute(stmt):
        # A row written by hand with the wrong types is left alone rather than guessed at.
        if isinstance(run_id, str) and _is_number(created_at):
            found.append(
                RunActivity(
                    run_id=run_id,
                    created_at=float(created_at),
                    last_wall=float(last_wall) if _is_number(last_wall) else None,
                    events=int(count),
                )
            )
    return found


def _run_keyed_tables(conn: Connection) -> tuple[Table, ...]:
    """Every table of the schema with a run id that this journal has, children first and
    `runs` last, so that no foreign key is left pointing at a removed run."""
    present = inspect(conn)
    children = [
        table
        for table in reversed(metadata.sorted_tables)
        if table is not runs and "run_id" in table.c and present.has_table(table.name)
    ]
    return (*children, runs)


class _Removal:
    """Deletes runs in bounded transactions, counting what it removed."""

    def __init__(
        self,
        journal: Journal,
        reader: Engine,
        tables: tuple[Table, ...],
        pause: Callable[[float], None],
    ) -> None:
        self._journal = journal
        self._reader = reader
        self._tables = tables
        self._pause = pause
        self.runs = 0
        self.events = 0

    def remove(self, selected: Sequence[RunActivity]) -> None:
        batch: list[str] = []
        batch_events = 0
        for run in selected:
            count = run.events
            if count > EVENTS_PER_TRANSACTION:
                self._remove_events_in_chunks(run.run_id)
                count = 0
            if batch and (
                len(batch) >= RUNS_PER_TRANSACTION or batch_events + count > EVENTS_PER_TRANSACTION
            ):
                self._remove_runs(batch)
                batch, batch_events = [], 0
            batch.append(run.run_id)
            batch_events += count
        if batch:
            self._remove_runs(batch)

    def _remove_runs(self, run_ids: list[str]) -> None:
        counts = self._transaction([delete(t).where(t.c.run_id.in_(run_ids)) for t in self._tables])
        for table, count in zip(self._tables, counts, strict=True):
            if table is events:
                self.events += count
        self.runs += counts[-1]  # `runs` comes last

    def _remove_events_in_chunks(self, run_id: str) -> None:
        """A run's events, a bounded range of (rank, seq) per transaction."""
        stmt = (
            select(events.c.rank, func.min(events.c.seq), func.max(events.c.seq))
            .where(events.c.run_id == run_id)
            .group_by(events.c.rank)
        )
        with self._reader.connect() as conn:
            ranges = [
                (int(rank), int(first), int(last)) for rank, first, last in conn.execute(stmt)
            ]
        for rank, first, last in ranges:
            for low in range(first, last + 1, EVENTS_PER_TRANSACTION):
                (count,) = self._transaction(
                    [
                        delete(events).where(
                            events.c.run_id == run_id,
                            events.c.rank == rank,
                            events.c.seq >= low,
                            events.c.seq < low + EVENTS_PER_TRANSACTION,
                        )
                    ]
                )
                self.events += count

    def _transaction(self, statements: Sequence[Delete]) -> list[int]:
        """Run `statements` in one transaction; the rows each deleted."""
        attempt = 0
        while True:
            started = time.monotonic()
            try:
                with self._journal.engine.begin() as conn:
                    counts = [conn.execute(statement).rowcount for statement in statements]
            except DATABASE_ERRORS as exc:
                attempt += 1
                if is_retryable(exc) and attempt <= LOCKED_RETRIES:
                    self._pause(0.05 * attempt)
                    continue
                raise journal_error(
                    exc, self._journal.location, writing=True, opened=True
                ) from None
            self._pause(max(MIN_PAUSE_S, time.monotonic() - started))
            return counts


def _truncate_wal(journal: Journal) -> None:
    """Fold the WAL back into the file and truncate it. A TRUNCATE checkpoint holds writers
    off while it waits for readers, so it waits briefly and is given up when busy: SQLite
    checkpoints again later. Freed pages stay in the file, reused by later appends; VACUUM
    would rewrite the whole file with every writer blocked."""
    try:
        raw = journal.engine.raw_connection()
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True, opened=True) from None
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA busy_timeout=1000")
        cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        cursor.fetchall()
        cursor.close()
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True, opened=True) from None
    finally:
        raw.close()


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
