"""The journal: opening one, its runs, and reading its events back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import Engine, Text, cast, func, null, select, type_coerce
from sqlalchemy.pool import PoolProxiedConnection

from lifecycle.core.errors import JournalError, NotAJournal
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.store.backends.backend import Backend, backend_for
from lifecycle.store.backends.dberrors import (
    DATABASE_ERRORS,
    Fault,
    fault_of,
    journal_error,
    write_failure,
)
from lifecycle.store.backends.revisions import (
    EMPTY,
    check_head,
    head_revision,
    migrate,
    read_revision,
)
from lifecycle.store.backends.schema import KNOWN_REVISIONS, events, runs
from lifecycle.store.decode import EVENT_ROW, decode_row
from lifecycle.store.rows import RunRow, is_int, is_number, json_column, without_secrets
from lifecycle.store.summaries import SUMMARY_REVISION, Summary, backfill, read_summaries
from lifecycle.store.writer import RankWriter, StoredRow, collective_columns

READ_CHUNK = 256  # rows fetched at a time per stream: readers merge many streams at once


class Journal:
    """One journal, opened for reading or for writing."""

    def __init__(
        self,
        *,
        backend: Backend,
        engine: Engine,
        writable: bool,
        revision: str,
        keeper: PoolProxiedConnection | None = None,
    ) -> None:
        self.backend = backend
        self.engine = engine
        self.location = backend.location
        self.writable = writable
        self.revision = revision
        self.malformed_rows: list[str] = []
        self._keeper = keeper

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open_for_read(cls, location: str) -> Journal:
        """Open an existing journal read-only; never writes to it, nor leaves a file beside it
        that a later writer could not write."""
        backend = backend_for(location)
        if not backend.has_data():
            raise NotAJournal(location=backend.location, reason="empty file")
        engine = backend.read_engine()
        try:
            revision = read_revision(engine, backend.location)
        except JournalError:
            engine.dispose()
            raise
        if revision == EMPTY:
            engine.dispose()
            raise NotAJournal(location=backend.location, reason="an empty database")
        # A reader's connections come and go; one held open (and read through once) keeps
        # a SQLite journal's WAL index mapped, so that once every writer has closed, no
        # connection rebuilds it by reading the whole WAL (a launcher's final reads took a
        # tenth of a second each after its ranks had exited).
        keeper = backend.keeper(engine)
        if keeper is not None:
            cursor = keeper.cursor()
            try:
                cursor.execute("SELECT count(*) FROM sqlite_master").fetchall()
            finally:
                cursor.close()
        # Reading never writes, so an older revision of our own is read as it is.
        return cls(backend=backend, engine=engine, writable=False, revision=revision, keeper=keeper)

    @classmethod
    def open_for_write(cls, location: str, *, upgrade: bool = False) -> Journal:
        """Open a journal to append to, creating its tables in a new or empty database.

        A journal at an older revision is migrated only when `upgrade` is true; anything that
        is not a journal of this lifecycle, or that this process may not write, is refused
        before a byte of it is written.
        """
        backend = backend_for(location)
        shown = backend.location
        if not backend.prepare_write():
            # Inspect through a read-only connection first: switching a foreign SQLite
            # database to WAL would already change its bytes.
            probe = backend.read_engine()
            try:
                revision = read_revision(probe, shown)
            finally:
                probe.dispose()
            if revision == head_revision():
                # Our journal, current: nothing to create, no lock to take.
                return cls._writable(backend, backend.write_engine())
            if not upgrade:
                check_head(revision, shown)
        with backend.migration_lock():
            engine = backend.write_engine()
            try:
                migrate(engine, shown, backend.url, upgrade=upgrade)
            except BaseException:
                engine.dispose()
                raise
        return cls._writable(backend, engine)

    @classmethod
    def _writable(cls, backend: Backend, engine: Engine) -> Journal:
        try:
            keeper = backend.keeper(engine)
        except DATABASE_ERRORS as exc:
            engine.dispose()
            raise journal_error(exc, backend.location, writing=True) from None
        return cls(
            backend=backend,
            engine=engine,
            writable=True,
            revision=head_revision(),
            keeper=keeper,
        )

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
            self._keeper = None
        self.engine.dispose()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs ----------------------------------------------------------------------------------

    def create_run(self, row: RunRow) -> None:
        """Record a run, without any password it names; a second call with the same run id
        (another rank) is a no-op."""
        row = without_secrets(row)
        values = {
            "run_id": row.run_id,
            "created_at": row.created_at,
            "host": row.host,
            "world_size": row.world_size,
            "config": row.config,
            "lifecycle_version": row.lifecycle_version,
            "command": row.command,
        }
        try:
            with self.engine.begin() as conn:
                exists = conn.execute(
                    select(runs.c.run_id).where(runs.c.run_id == row.run_id)
                ).first()
                if exists is None:
                    conn.execute(runs.insert().values(**values))
        except DATABASE_ERRORS as exc:
            fault = fault_of(exc)
            if fault is Fault.DUPLICATE_KEY:
                return  # another rank recorded it between our check and insert
            if fault is Fault.CONSTRAINT:
                raise journal_error(exc, self.location, opened=True) from None
            raise write_failure(exc, self.location) from None

    def runs(self) -> list[RunRow]:
        # `command` exists from revision 0002 on; older journals read as NULL.
        command = (
            runs.c.command
            if KNOWN_REVISIONS.index(self.revision) >= KNOWN_REVISIONS.index("0002")
            else null().label("command")
        )
        stmt = select(
            runs.c.run_id,
            runs.c.created_at,
            runs.c.host,
            runs.c.world_size,
            type_coerce(runs.c.config, Text),
            runs.c.lifecycle_version,
            command,
        ).order_by(runs.c.created_at, runs.c.run_id)
        out: list[RunRow] = []
        # Runs started with the same flags hold the same config text: each text is decoded
        # once, and its runs share the (read-only) result.
        decoded: dict[str, object] = {}
        try:
            with self.engine.connect() as conn:
                for row in conn.execute(stmt):
                    run = self._run_row(row, decoded)
                    if run is not None:
                        out.append(run)
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None
        return out

    def _run_row(self, row: Any, decoded: dict[str, object]) -> RunRow | None:
        """One `runs` row, or None (and a line in malformed_rows) when its columns do not hold
        what a run needs: a journal damaged or written by hand is read for what it holds."""
        run_id, created_at, host, world_size, config, version, launched = row
        if not isinstance(config, str):
            parsed = config
        elif config in decoded:
            parsed = decoded[config]
        else:
            parsed = decoded[config] = json_column(config)
        if not isinstance(parsed, dict):
            self.malformed_rows.append(f"run {run_id}: config is not a JSON object")
            parsed = {}
        if not (isinstance(run_id, str) and is_number(created_at) and is_int(world_size)):
            self.malformed_rows.append(
                f"run {run_id!r}: run_id, created_at or world_size of the wrong type"
            )
            return None
        # A journal written before passwords were hidden is shown without them all the same.
        return without_secrets(
            RunRow(
                run_id=run_id,
                created_at=float(created_at),
                host=str(host),
                world_size=world_size,
                config=parsed,
                lifecycle_version=str(version),
                command=launched if isinstance(launched, str) else None,
            )
        )

    # -- events --------------------------------------------------------------------------------

    def writer(self, *, run_id: str, rank: int, resume: bool = False) -> RankWriter:
        """The writer of a rank with no events yet; with `resume`, of one that has some, going
        on after its last (what a copy does to complete a rank copied part way)."""
        if not self.writable:
            raise JournalError(f"{self.location}: opened read-only")
        after = None
        if resume:
            after = RankFold(run_id=run_id, rank=rank)
            for stored in self.read(run_id=run_id, rank=rank):
                after.apply(stored)
        return RankWriter(
            engine=self.engine, backend=self.backend, run_id=run_id, rank=rank, after=after
        )

    def last_collectives(self, run_id: str, rank: int, count: int) -> list[StoredEvent]:
        """A rank's last `count` collective records (started and finished), in seq order."""
        if not self.has_summaries or count <= 0:
            return []  # before revision 0003 no column tells a collective record cheaply
        stmt = (
            EVENT_ROW.where(
                events.c.run_id == run_id,
                events.c.rank == rank,
                events.c.group_name.is_not(None),
            )
            .order_by(events.c.seq.desc())
            .limit(count)
        )
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(stmt).all()
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None
        found = (self._stored(row) for row in reversed(rows))
        return [stored for stored in found if stored is not None]

    def read(
        self, *, run_id: str | None = None, rank: int | None = None, from_seq: int = 0
    ) -> Iterator[StoredEvent]:
        """Events in (run_id, rank, seq) order, decoded; unknown or corrupt payloads included."""
        stmt = EVENT_ROW.order_by(events.c.run_id, events.c.rank, events.c.seq)
        if run_id is not None:
            stmt = stmt.where(events.c.run_id == run_id)
        if rank is not None:
            stmt = stmt.where(events.c.rank == rank)
        if from_seq:
            stmt = stmt.where(events.c.seq >= from_seq)
        for row in self._rows(stmt):
            stored = self._stored(row)
            if stored is not None:
                yield stored

    def _rows(self, stmt: Any) -> Iterator[Any]:
        """The statement's rows, READ_CHUNK at a time (a journal of millions of events is
        never held at once); a database error is the journal's."""
        try:
            with self.engine.connect() as conn:
                result = conn.execution_options(yield_per=READ_CHUNK).execute(stmt)
                for chunk in result.partitions():
                    yield from chunk
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None

    def read_rows(self, *, run_id: str, rank: int, from_seq: int = 0) -> Iterator[StoredRow]:
        """One rank's rows in seq order as they are stored, each with the event it decodes to
        (what `lifecycle db copy` writes again, an undecodable payload included). A row that
        cannot be written again as it is (its envelope malformed, its payload not text) is
        left out, and said in `malformed_rows`: one line for each."""
        # The columns that index collective records exist from the summaries' revision on;
        # before it they are derived from the event, as its writer would have.
        indexed = self.has_summaries
        stmt = (
            EVENT_ROW.add_columns(events.c.group_name, events.c.group_seq, events.c.op)
            if indexed
            else EVENT_ROW
        )
        if self.engine.dialect.name != "sqlite":  # a server's driver decodes JSON (a dict)
            columns = list(stmt.selected_columns)
            columns[8] = cast(events.c.data, Text)  # the text its writer stored
            stmt = stmt.with_only_columns(*columns)
        stmt = stmt.where(events.c.run_id == run_id, events.c.rank == rank).order_by(events.c.seq)
        if from_seq:
            stmt = stmt.where(events.c.seq >= from_seq)
        for row in self._rows(stmt):
            stored, problems = decode_row(row[:9], self.location)
            _, _, _, _, _, kind, version, _, data = row[:9]
            if stored is not None and isinstance(data, str):
                collective = tuple(row[9:12]) if indexed else collective_columns(stored.event)
                yield StoredRow(
                    stored=stored, kind=kind, version=version, data=data, collective=collective
                )
            else:
                self.malformed_rows.append(
                    problems[0]
                    if problems
                    else f"{self.location}: run {run_id} rank {rank} seq {row[2]!r}: payload is"
                    " not text"
                )

    @property
    def has_summaries(self) -> bool:
        """Whether this journal's writers kept summary rows (revision 0003 on)."""
        return KNOWN_REVISIONS.index(self.revision) >= KNOWN_REVISIONS.index(SUMMARY_REVISION)

    def summaries(
        self, run_ids: list[str] | None = None, *, checkpoints: bool = True
    ) -> list[Summary]:
        """The summary rows of the given runs (every run's when None), with their fold
        checkpoints unless `checkpoints` is false; none before 0003."""
        if not self.has_summaries:
            return []
        try:
            with self.engine.connect() as conn:
                return read_summaries(conn, run_ids, checkpoints=checkpoints)
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None

    def backfill_summaries(self) -> int:
        """Summarize every rank that has events and no summary (written before revision
        0003); how many were summarized."""
        if not self.writable:
            raise JournalError(f"{self.location}: opened read-only")
        try:
            with self.engine.connect() as conn:
                return sum(
                    1
                    for _ in backfill(
                        conn, lambda run_id, rank: self.read(run_id=run_id, rank=rank)
                    )
                )
        except DATABASE_ERRORS as exc:
            raise write_failure(exc, self.location) from None

    def last_seq(self, run_id: str, rank: int) -> int | None:
        """The highest sequence number of a rank's events, None when it has none."""
        stmt = select(func.max(events.c.seq)).where(
            events.c.run_id == run_id, events.c.rank == rank
        )
        try:
            with self.engine.connect() as conn:
                value = conn.execute(stmt).scalar()
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None
        return value if is_int(value) else None

    def ranks(self, run_id: str) -> list[int]:
        """The ranks that have events of `run_id` in this journal."""
        stmt = select(events.c.rank).where(events.c.run_id == run_id).distinct()
        try:
            with self.engine.connect() as conn:
                return sorted(int(r) for r in conn.execute(stmt).scalars() if is_int(r))
        except DATABASE_ERRORS as exc:
            raise journal_error(exc, self.location, opened=True) from None

    def _stored(self, row: Any) -> StoredEvent | None:
        stored, problems = decode_row(row, self.location)
        self.malformed_rows.extend(problems)
        return stored
