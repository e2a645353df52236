"""The rank writer: one rank's gapless appends, each committed before it returns."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, select

from lifecycle.core.decisions.learnedshapes import LearnedTraffic
from lifecycle.core.errors import JournalConflict, JournalError, JournalWriteFailed
from lifecycle.core.format.codec import encode
from lifecycle.core.format.events import CollectiveFinished, CollectiveStarted, Event, StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.store.backends.backend import Backend
from lifecycle.store.backends.dberrors import (
    DATABASE_ERRORS,
    append_error,
    is_retryable,
    journal_error,
)
from lifecycle.store.backends.schema import (
    events,
)
from lifecycle.store.learned.artifacts import ArtifactStore
from lifecycle.store.learned.history import HistoryRead, history_values, recent_history
from lifecycle.store.learned.references import reference_output
from lifecycle.store.learned.served import fingerprint_runs, served_requests
from lifecycle.store.learned.verifiedplans import planned_inputs, residency_history
from lifecycle.store.statements import statements_for
from lifecycle.store.summaries import checkpoint_values, summary_values

# A lock the busy timeout did not outwait (SQLite), or a serialisation failure (a server):
# tried again a few times, briefly, before the write counts as failed.
LOCKED_RETRIES = 5
_COLUMN_ORDER = (
    "run_id", "rank", "seq", "wall_time", "mono_ns", "kind", "version", "state", "data",
    "group_name", "group_seq", "op",
)  # fmt: skip
# The fold's checkpoint is rewritten at least every this many events, so that a reader folds
# at most this many after it (the summary row itself is current with every append).
CHECKPOINT_EVERY = 64
# Kinds after which a rank may well write nothing more: its checkpoint is taken with them, so
# that an ended, failed or dumped rank is read without any event after its checkpoint.
_CLOSING_KINDS = frozenset(
    {"shutdown", "error", "collectives_dumped", "stalled", "flight_recorder_dumped"}
)

_Read = TypeVar("_Read")  # what a read on a connection of its own returns


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRow:
    """An event row as a journal holds it: the event it decodes to, in its envelope, and its
    kind, version and payload text as written (an unknown kind's included)."""

    stored: StoredEvent
    kind: str
    version: int
    data: str
    collective: tuple[str | None, int | None, str | None]  # group_name, group_seq, op


def collective_columns(event: Event) -> tuple[str | None, int | None, str | None]:
    """The columns that index a collective record: its group, sequence number and op."""
    if isinstance(event, CollectiveStarted | CollectiveFinished):
        return event.group, event.group_seq, event.op
    return None, None, None


class RankWriter:
    """Appends one rank's events with gapless sequence numbers, each committed before return.

    Thread-safe: the rank's main thread and its heartbeat thread share one writer.
    """

    def __init__(
        self,
        *,
        engine: Engine,
        backend: Backend,
        run_id: str,
        rank: int,
        after: RankFold | None = None,
    ) -> None:
        """A writer of a rank with no events yet; or, given `after` (the fold of every event
        the rank has), one that goes on from them (`lifecycle db copy` completing a rank)."""
        self.run_id = run_id
        self.rank = rank
        self._location = backend.location
        self._url = backend.url
        self._engine = engine
        self._lock = threading.Lock()
        self._failure: JournalWriteFailed | None = None
        try:
            self._conn = engine.connect()
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self._location, opened=True) from None
        compiled = statements_for(engine.dialect)
        self._positional = compiled.events_positional
        self._order = compiled.events_order
        try:
            existing = self._conn.execute(
                select(events.c.seq)
                .where(events.c.run_id == run_id, events.c.rank == rank)
                .limit(1)
            ).first()
            self._conn.rollback()
            self._appender = backend.appender(self._conn, compiled.events_insert)
        except DATABASE_ERRORS as exc:
            self._conn.close()
            raise journal_error(exc, self._location, opened=True) from None
        if (existing is not None) != (after is not None):
            self._appender.close()
            self._conn.close()
            raise JournalConflict(run_id=run_id, rank=rank, seq=0 if after is None else -1)
        self._next_seq = 0 if after is None else after.last_seq + 1
        self._summarized = after is not None  # the rank's summary row exists
        # Its history row is written with the append that finishes its ready action, once.
        self._historized = after is not None and after.ready_action_done
        # Its latest heartbeat kept in place in its summary row (see `beat`), if newer than
        # the last one journaled.
        self._beat_wall: float | None = None
        self._closed = False
        self.write_s = 0.0  # time spent committing appends, for the shutdown record
        self._summary_insert = compiled.summary_insert
        self._summary_update = compiled.summary_update
        self._checkpoint_insert = compiled.checkpoint_insert
        self._checkpoint_update = compiled.checkpoint_update
        self._history_insert = compiled.history_insert
        self._beat_update = compiled.beat_update
        self._fold = after or RankFold(run_id=run_id, rank=rank)
        # Going on from earlier events: the first append takes a checkpoint.
        self._fold_seq = -1 if after is None else -CHECKPOINT_EVERY

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def append(self, event: Event, *, state: str, wall_time: float, mono_ns: int) -> StoredEvent:
        """Append one event; it is committed when this returns."""
        return self.append_batch([(event, state, wall_time, mono_ns)])[0]

    def append_batch(self, items: list[tuple[Event, str, float, int]]) -> list[StoredEvent]:
        """Append (event, state, wall_time, mono_ns) items in one transaction: a reader sees
        all of them or none."""
        payloads = [encode(item[0]) for item in items]
        with self._lock:
            self._check_writable()
            first = self._next_seq
            stored = [
                StoredEvent(
                    run_id=self.run_id,
                    rank=self.rank,
                    seq=first + offset,
                    wall_time=wall_time,
                    mono_ns=mono_ns,
                    state=state,
                    event=event,
                )
                for offset, (event, state, wall_time, mono_ns) in enumerate(items)
            ]
            self._write(
                stored,
                [
                    self._row(
                        item,
                        (item.event.kind, item.event.version, payload),
                        collective_columns(item.event),
                    )
                    for item, payload in zip(stored, payloads, strict=True)
                ],
            )
        return stored

    def append_rows(self, rows: Sequence[StoredRow]) -> None:
        """Append rows another journal holds, in one transaction, each as it is there: its own
        seq (a gap stays a gap), kind, version and payload text (`lifecycle db copy`)."""
        with self._lock:
            self._check_writable()
            after = self._next_seq - 1
            for row in rows:
                if row.stored.seq <= after:
                    raise JournalError(
                        f"{self._location}: seq {row.stored.seq} of run {self.run_id} rank"
                        f" {self.rank} does not come after seq {after}"
                    )
                after = row.stored.seq
            self._write(
                [row.stored for row in rows],
                [
                    self._row(row.stored, (row.kind, row.version, row.data), row.collective)
                    for row in rows
                ],
            )

    def _check_writable(self) -> None:
        if self._failure is not None:
            # A write failed: appending past it would leave a hole that the gapless
            # sequence numbers hide, so this writer records nothing more.
            raise JournalWriteFailed(location=self._location, reason=self._failure.reason)
        if self._closed:
            raise JournalError(f"{self._location}: writer for rank {self.rank} is closed")

    def _row(
        self,
        stored: StoredEvent,
        payload: tuple[str, int, str],
        collective: tuple[str | None, int | None, str | None],
    ) -> Any:
        """The INSERT's parameters for one event row (its kind, version and data text in
        `payload`), in the driver's form."""
        kind, version, data = payload
        row = (self.run_id, self.rank, stored.seq, stored.wall_time, stored.mono_ns, kind,
               version, stored.state, data, *collective)  # fmt: skip
        if self._positional and self._order == _COLUMN_ORDER:
            return row
        values = dict(zip(_COLUMN_ORDER, row, strict=True))
        return tuple(values[k] for k in self._order) if self._positional else values

    def _write(self, stored: list[StoredEvent], rows: list[Any]) -> None:
        """Commit `rows` (of the events `stored`) with the summary they bring; under the lock."""
        if not stored:
            return
        started = time.perf_counter()
        for item in stored:
            self._fold.apply(item)
        self._insert(rows, stored[0].seq, self._summary(stored))
        self._summarized = True
        self.write_s += time.perf_counter() - started
        self._next_seq = stored[-1].seq + 1

    def _summary(self, stored: list[StoredEvent]) -> list[tuple[str, Any]]:
        """The statements that bring this rank's summary row up to the batch, in its
        transaction, and a new checkpoint of the fold when the batch holds an event that may
        end the rank's journal, or the last one is CHECKPOINT_EVERY events old."""
        fold = self._fold
        new = not self._summarized
        closing = any(item.event.kind in _CLOSING_KINDS for item in stored)
        fresh = new or closing or fold.last_seq - self._fold_seq >= CHECKPOINT_EVERY
        key = {"key_run_id": self.run_id, "key_rank": self.rank}
        row = {"run_id": self.run_id, "rank": self.rank} if new else key
        then = [self._summary_insert if new else self._summary_update]
        summary = summary_values(fold)
        if self._beat_wall is not None and self._beat_wall > (summary["last_heartbeat_wall"] or 0):
            summary["last_heartbeat_wall"] = self._beat_wall
        values = [{**row, **summary}]
        if fresh:
            self._fold_seq = fold.last_seq
            then.append(self._checkpoint_insert if new else self._checkpoint_update)
            values.append({**row, **checkpoint_values(fold)})
        if not self._historized and fold.ready_action_done:
            self._historized = True
            history = history_values(fold)
            if history is not None:
                then.append(self._history_insert)
                values.append({"run_id": self.run_id, "rank": self.rank, **history})
        return [(st.sql, st.params(v)) for st, v in zip(then, values, strict=True)]

    def beat(self, wall: float) -> None:
        """Keep `wall` as the rank's latest heartbeat in its summary row, updated in place and
        committed before this returns: a heartbeat that journals no event (after ready, when
        nothing a reader places the rank by has changed). Readers judge liveness from it."""
        with self._lock:
            self._check_writable()
            if not self._summarized:
                return  # no row yet: its first event makes it, and beats go on after that
            self._beat_wall = wall
            journaled = self._fold.last_heartbeat_wall
            values = {
                "key_run_id": self.run_id,
                "key_rank": self.rank,
                "last_heartbeat_wall": wall if journaled is None else max(wall, journaled),
            }
            sql, params = self._beat_update.sql, self._beat_update.params(values)
            for attempt in range(LOCKED_RETRIES + 1):
                try:
                    self._conn.exec_driver_sql(sql, params)
                    self._conn.commit()
                    return
                except DATABASE_ERRORS as exc:
                    with contextlib.suppress(*DATABASE_ERRORS):
                        self._conn.rollback()
                    if is_retryable(exc) and attempt < LOCKED_RETRIES:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    error = append_error(
                        exc,
                        location=self._location,
                        run_id=self.run_id,
                        rank=self.rank,
                        seq=self._next_seq,
                    )
                    if isinstance(error, JournalWriteFailed):
                        self._failure = error
                    raise error from None

    def _insert(self, rows: list[Any], seq: int, then: list[tuple[str, Any]]) -> None:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                self._appender.insert(rows, then)
                return
            except DATABASE_ERRORS as exc:
                self._appender.rollback()
                if is_retryable(exc) and attempt < LOCKED_RETRIES:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                error = append_error(
                    exc, location=self._location, run_id=self.run_id, rank=self.rank, seq=seq
                )
                if isinstance(error, JournalWriteFailed):
                    self._failure = error
                raise error from None

    def residency_history(self, model: str) -> list[StoredEvent]:
        """Rank 0's residency events of `model`'s newest runs, newest first (store.plans)."""
        return self._read_apart(lambda conn: residency_history(conn, model))

    def startup_history(self, key: str, *, ranks: int) -> HistoryRead:
        """The history rows of the newest runs of `key` (store.history)."""
        return self._read_apart(lambda conn: recent_history(conn, key, ranks=ranks))

    def served(self, fingerprint_key: str) -> LearnedTraffic:
        """The requests the newest healthy runs of `fingerprint_key` served, and their times
        to ready (store.served)."""

        def read(conn: Connection) -> LearnedTraffic:
            found = fingerprint_runs(conn, fingerprint_key)
            return LearnedTraffic(
                requests=served_requests(conn, [run for run, _ in found], self._location),
                ready_s=[ready for _, ready in found if ready is not None],
            )

        return self._read_apart(read)

    def reference_output(self, reference_key: str, *, rank: int) -> tuple[str, str] | None:
        """The reference output of `reference_key` on `rank` (store.references)."""
        return self._read_apart(
            lambda conn: reference_output(conn, reference_key, rank=rank, location=self._location)
        )

    def artifacts(self) -> ArtifactStore:
        """The journal's compile artifacts (store.artifacts)."""
        return ArtifactStore(self._engine, self._url)

    def planned_inputs(self, run_id: str) -> list[StoredEvent]:
        """Every rank's `residency_planned` events of `run_id` (store.plans)."""
        return self._read_apart(lambda conn: planned_inputs(conn, run_id))

    def _read_apart(self, read: Callable[[Connection], _Read]) -> _Read:
        """`read` on a connection of its own, apart from this writer's appends; a database's
        error is the journal's."""
        try:
            with self._engine.connect() as conn:
                return read(conn)
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self._location, opened=True) from None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._appender.close()
                self._conn.close()
