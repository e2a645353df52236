"""The journal: a write-ahead, append-only event store over SQLAlchemy Core."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from sqlalchemy import (
    Connection,
    Engine,
    Text,
    create_engine,
    event,
    inspect,
    null,
    select,
    text,
    type_coerce,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.pool import NullPool

from lifecycle.core.errors import (
    JournalConflict,
    JournalError,
    JournalNotFound,
    JournalWriteFailed,
    NotAJournal,
    SchemaMismatch,
)
from lifecycle.core.events import (
    UNKNOWN_KIND,
    Event,
    StoredEvent,
    UnknownEvent,
    decode_or_unknown,
    encode,
)
from lifecycle.store.schema import KNOWN_REVISIONS, events, runs

SQLITE_HEADER = b"SQLite format 3\x00"
BUSY_TIMEOUT_S = 30.0
LOCKED_RETRIES = 5
_COLUMN_ORDER = (
    "run_id", "rank", "seq", "wall_time", "mono_ns", "kind", "version", "state", "data"
)  # fmt: skip
READ_CACHE_KIB = 128
READ_CHUNK = 256  # rows fetched at a time per stream: readers merge many streams at once
REQUIRED_TABLES = frozenset({"runs", "events"})


@dataclass(frozen=True, slots=True, kw_only=True)
class RunRow:
    run_id: str
    created_at: float
    host: str
    world_size: int
    config: dict[str, Any]
    lifecycle_version: str
    command: str | None = None  # None in journals older than revision 0002


# RFC 3986: scheme = ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ); anything else is a file path,
# whatever `?`, `%` or `#` it holds.
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
MAX_SHOWN_CHARS = 160
# The pip package that provides a database driver module, where the two names differ.
DRIVER_PACKAGES = {
    "psycopg": "psycopg[binary]",
    "psycopg2": "psycopg2-binary",
    "pymysql": "PyMySQL",
    "MySQLdb": "mysqlclient",
    "cx_Oracle": "cx-Oracle",
}


def is_url(location: str) -> bool:
    return _URL_SCHEME.match(location) is not None


def to_url(location: str) -> str:
    """A SQLAlchemy URL for a journal given as a URL or as a file path."""
    if is_url(location):
        return location
    path = os.path.abspath(os.path.expanduser(location))
    # Rendered by SQLAlchemy, which quotes `?`, `%` and `#` in the path so that parsing the
    # URL gives the same path back.
    return URL.create("sqlite", database=path).render_as_string(hide_password=False)


def shown_location(location: str) -> str:
    """A journal's location as messages print it: no URL password, no endless file name."""
    shown = location
    if is_url(location):
        with contextlib.suppress(ArgumentError, ValueError):
            shown = make_url(location).render_as_string(hide_password=True)
    if len(shown) > MAX_SHOWN_CHARS:
        shown = f"{shown[:60]}...{shown[-40:]} ({len(shown)} characters)"
    return shown


def _parse_url(url: str, location: str) -> URL:
    try:
        return make_url(url)
    except (ArgumentError, ValueError):
        raise JournalError(f"{location}: not a database URL or a file path") from None


def _sqlite_path(url: str, location: str) -> Path | None:
    parsed = _parse_url(url, location)
    if not parsed.drivername.startswith("sqlite"):
        return None
    if not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def _url_engine(url: str, location: str) -> Engine:
    """An engine for a database URL that is not a SQLite file; a URL naming an unknown
    database, or a driver that is not installed, is refused in one line."""
    parsed = _parse_url(url, location)
    try:
        return create_engine(parsed, poolclass=NullPool)
    except NoSuchModuleError:
        raise JournalError(
            f"{location}: no database dialect {parsed.drivername!r} is installed"
            " (a journal is a file path, or a URL such as postgresql+psycopg://HOST/DB)"
        ) from None
    except ImportError as exc:
        module = (exc.name or "").split(".")[0]
        if not module:
            raise JournalError(
                f"{location}: the database driver cannot be loaded ({exc})"
            ) from None
        package = DRIVER_PACKAGES.get(module, module)
        raise JournalError(
            f"{location}: the database driver {module!r} for {parsed.drivername!r} is not"
            f" installed: pip install '{package}'"
        ) from None
    except ArgumentError as exc:
        message = str(exc).splitlines()[0]
        raise JournalError(f"{location}: not a usable database URL ({message})") from None


# ---------------------------------------------------------------------------------------------
# Schema revisions (Alembic)


def migrations_dir() -> Path:
    """The Alembic scripts: `migrations/` of a checkout, `lifecycle/migrations` when installed."""
    spec = importlib.util.find_spec("lifecycle.migrations")
    if spec is None or spec.origin is None:
        raise JournalError("the journal migrations are not installed with lifecycle")
    return Path(spec.origin).parent


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def known_revisions() -> tuple[str, ...]:
    """Every revision this lifecycle knows, oldest first; the last is head."""
    return KNOWN_REVISIONS


def script_revisions() -> tuple[str, ...]:
    """The revisions of the Alembic scripts, oldest first (imports Alembic)."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    heads = script.get_heads()
    if len(heads) != 1:
        raise JournalError(f"the journal migrations have {len(heads)} heads, expected one")
    return tuple(reversed([rev.revision for rev in script.walk_revisions()]))


def head_revision() -> str:
    return known_revisions()[-1]


EMPTY = "empty"


def _schema_revision(conn: Connection, location: str) -> str:
    """The journal's revision, or EMPTY for a database with no tables at all."""
    if conn.dialect.name == "sqlite":
        rows = conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type = 'table'")
        tables = {str(name) for (name,) in rows}
    else:
        tables = set(inspect(conn).get_table_names())
    if "alembic_version" not in tables:
        if not tables:
            return EMPTY
        listed = ", ".join(sorted(tables)[:5])
        raise NotAJournal(location=location, reason=f"a database of another program ({listed})")
    versions = [
        str(v) for v in conn.execute(text("SELECT version_num FROM alembic_version")).scalars()
    ]
    if len(versions) != 1:
        raise NotAJournal(location=location, reason=f"{len(versions)} schema revisions recorded")
    revision = versions[0]
    known = known_revisions()
    if revision not in known:
        raise SchemaMismatch(
            location=location,
            found=revision,
            expected=head_revision(),
            hint="unknown to this lifecycle: written by a newer lifecycle or another program;"
            " upgrade lifecycle to read it",
        )
    if revision == head_revision() and not tables >= REQUIRED_TABLES:
        raise NotAJournal(location=location, reason="journal tables are missing")
    return revision


def _check_head(revision: str, location: str) -> None:
    if revision not in (head_revision(), EMPTY):
        raise SchemaMismatch(
            location=location,
            found=revision,
            expected=head_revision(),
            hint=f"older: run `lifecycle db upgrade --db {location}`",
        )


# ---------------------------------------------------------------------------------------------
# Engines


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def _os_reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)


def _stat(path: Path, location: str) -> os.stat_result | None:
    """The file's status, following links; None when there is no such file."""
    try:
        return path.stat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(f"{location}: cannot be opened: {_os_reason(exc)}") from None


def _check_sqlite_file(path: Path, location: str) -> bool:
    """Refuse a file that is not a SQLite database; True when it is missing or empty.

    Only a regular file can be a journal: SQLite would open a device or a FIFO and create its
    own files beside it (`/dev/null-journal`).
    """
    status = _stat(path, location)
    if status is None:
        return True
    for is_kind, kind in _FILE_KINDS:
        if is_kind(status.st_mode):
            raise NotAJournal(location=location, reason=f"not a regular file ({kind})")
    size = status.st_size
    if size == 0:
        return True
    try:
        with path.open("rb") as fh:
            header = fh.read(100)
    except OSError as exc:
        raise JournalError(f"{location}: cannot be read: {_os_reason(exc)}") from None
    if not header.startswith(SQLITE_HEADER):
        raise NotAJournal(location=location, reason="not a SQLite database")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if len(header) < 100 or page_size < 512 or size < page_size or size % page_size:
        raise NotAJournal(location=location, reason=f"truncated SQLite file ({size} bytes)")
    return False


def _sidecar(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _read_uri(path: Path) -> str:
    """How a reader opens a journal without writing anything a later writer would trip on.

    A WAL journal read with `mode=ro` needs its -wal and -shm files: SQLite creates them when
    they are missing, with the journal's permission bits, and a read-only connection leaves
    them behind. Where they would not be writable for the journal's writer (a journal whose
    owner may not write it, or one this process cannot write, or whose directory it cannot
    write) and no -wal file exists, no writer has the journal open (a writer's connection
    keeps its -wal), so nothing can be appending: the journal is opened immutable, which
    reads the main file alone and creates nothing. Where a -wal exists, a writer may be
    appending, and only `mode=ro` sees its frames.
    """
    quoted = quote(str(path))
    writable = (
        path.stat().st_mode & stat.S_IWUSR != 0
        and os.access(path, os.W_OK)
        and os.access(path.parent, os.W_OK | os.X_OK)
    )
    if writable or _sidecar(path, "-wal").exists():
        return f"file:{quoted}?mode=ro"
    return f"file:{quoted}?mode=ro&immutable=1"


def _check_writable(path: Path, location: str) -> None:
    """Refuse, before a byte is written, a journal this process may not write: the file, its
    directory (SQLite creates -wal and -shm there), or -wal and -shm files left read-only."""
    directory = path.parent
    if not os.access(directory, os.W_OK | os.X_OK):
        raise JournalError(
            f"{location}: directory {shown_location(str(directory))} is not writable"
            " (a journal keeps its -wal and -shm files beside it)"
        )
    for candidate in (path, _sidecar(path, "-wal"), _sidecar(path, "-shm")):
        if candidate.exists() and not os.access(candidate, os.R_OK | os.W_OK):
            which = "" if candidate == path else f" (its {candidate.name[len(path.name) :]} file)"
            raise JournalError(f"{location}: cannot be written{which}: permission denied")


def _sqlite_engine(path: Path, *, write: bool) -> Engine:
    uri = f"file:{quote(str(path))}?mode=rwc" if write else _read_uri(path)

    def connect() -> sqlite3.Connection:
        # isolation_level=None: SQLAlchemy's begin hook below emits BEGIN itself, so that DDL
        # (the migrations) is transactional too.
        return sqlite3.connect(
            uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False, isolation_level=None
        )

    engine = create_engine("sqlite://", creator=connect, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: sqlite3.Connection, _record: object) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
        if not write:
            # A reader may hold one connection per rank at once (replay merges the streams);
            # a small page cache each (READ_CACHE_KIB) bounds its memory by the rank count,
            # whatever the journal's size.
            cur.execute(f"PRAGMA cache_size=-{READ_CACHE_KIB}")
        if write:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front: a writer waits in the busy handler instead
        # of failing when it upgrades a read lock that another writer has overtaken.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


# SQLite's primary result codes for a write that the disk refused: SQLITE_IOERR, SQLITE_FULL.
_SQLITE_DISK_FAILURES = frozenset({10, 13})


def _message(exc: BaseException) -> str:
    cause = getattr(exc, "orig", None) or exc
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def _translate(exc: Exception, location: str, *, writing: bool = False) -> JournalError:
    """A database error as a journal error; one the disk raised while `writing` is a failed
    write (exit 3), not bad input."""
    message = _message(exc)
    if "file is not a database" in message or "malformed" in message:
        return NotAJournal(location=location, reason=f"corrupt SQLite file ({message})")
    code = getattr(getattr(exc, "orig", None) or exc, "sqlite_errorcode", None)
    if writing and isinstance(code, int) and code & 0xFF in _SQLITE_DISK_FAILURES:
        return JournalWriteFailed(location=location, reason=message)
    return JournalError(f"{location}: {message}")


def _write_failure(exc: Exception, location: str) -> JournalError:
    """A failed write to a journal that opened fine: the record is incomplete from here on,
    whatever the database said (disk full, I/O error, locked past the busy timeout, a lost
    connection)."""
    translated = _translate(exc, location)
    if isinstance(translated, NotAJournal):
        return translated
    return JournalWriteFailed(location=location, reason=_message(exc))


# ---------------------------------------------------------------------------------------------
# The journal


class Journal:
    """One journal, opened for reading or for writing."""

    def __init__(
        self, *, engine: Engine, location: str, url: str, writable: bool, revision: str
    ) -> None:
        self.engine = engine
        self.location = location
        self.url = url
        self.writable = writable
        self.revision = revision
        self.malformed_rows: list[str] = []
        # A writable SQLite journal keeps one connection open while it is open: SQLite
        # checkpoints and deletes the WAL when its last connection closes, and short-lived
        # connections (the run row) would otherwise pay that, and the next writer would pay
        # for a new WAL, on the startup path.
        self._keeper: Any = (
            engine.raw_connection() if writable and engine.dialect.name == "sqlite" else None
        )

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open_for_read(cls, location: str) -> Journal:
        """Open an existing journal read-only; never writes to it, nor leaves a file beside it
        that a later writer could not write."""
        shown = shown_location(location)
        url = to_url(location)
        path = _sqlite_path(url, shown)
        if path is not None:
            if _stat(path, shown) is None:
                raise JournalNotFound(location=shown)
            if _check_sqlite_file(path, shown):
                raise NotAJournal(location=shown, reason="empty file")
            engine = _sqlite_engine(path, write=False)
        else:
            engine = _url_engine(url, shown)
        try:
            with engine.connect() as conn:
                revision = _schema_revision(conn, shown)
        except SQLAlchemyError as exc:
            engine.dispose()
            raise _translate(exc, shown) from None
        except JournalError:
            engine.dispose()
            raise
        if revision == EMPTY:
            engine.dispose()
            raise NotAJournal(location=shown, reason="an empty database")
        # Reading never writes, so an older revision of our own is read as it is.
        return cls(engine=engine, location=shown, url=url, writable=False, revision=revision)

    @classmethod
    def open_for_write(cls, location: str, *, upgrade: bool = False) -> Journal:
        """Open a journal to append to, creating its tables in a new or empty database.

        A journal at an older revision is migrated only when `upgrade` is true; anything that
        is not a journal of this lifecycle, or that this process may not write, is refused
        before a byte of it is written.
        """
        shown = shown_location(location)
        url = to_url(location)
        path = _sqlite_path(url, shown)
        if path is None:
            engine = _url_engine(url, shown)
            cls._migrate(engine, shown, url, upgrade=upgrade)
            return cls._writable(engine, shown, url)
        parent = _stat(path.parent, shown)
        if parent is None or not stat.S_ISDIR(parent.st_mode):
            raise JournalError(
                f"{shown}: directory {shown_location(str(path.parent))} does not exist"
            )
        new = _check_sqlite_file(path, shown)
        _check_writable(path, shown)
        if not new:
            # Inspect through a read-only connection first: switching a foreign database to
            # WAL would already change its bytes.
            probe = _sqlite_engine(path, write=False)
            try:
                with probe.connect() as conn:
                    revision = _schema_revision(conn, shown)
            except SQLAlchemyError as exc:
                raise _translate(exc, shown) from None
            finally:
                probe.dispose()
            if revision == head_revision():
                # Our journal, current: nothing to create, no lock to take.
                return cls._writable(_sqlite_engine(path, write=True), shown, url)
            if not upgrade:
                _check_head(revision, shown)
        with _creation_lock(path, shown):
            engine = _sqlite_engine(path, write=True)
            try:
                cls._migrate(engine, shown, url, upgrade=upgrade)
            except BaseException:
                engine.dispose()
                raise
        return cls._writable(engine, shown, url)

    @classmethod
    def _writable(cls, engine: Engine, location: str, url: str) -> Journal:
        try:
            return cls(
                engine=engine, location=location, url=url, writable=True, revision=head_revision()
            )
        except SQLAlchemyError as exc:
            engine.dispose()
            raise _translate(exc, location, writing=True) from None

    @staticmethod
    def _migrate(engine: Engine, location: str, url: str, *, upgrade: bool) -> None:
        from alembic import command

        try:
            with engine.connect() as conn:
                revision = _schema_revision(conn, location)
                if revision == head_revision():
                    conn.rollback()
                    return
                if revision != EMPTY and not upgrade:
                    _check_head(revision, location)
                cfg = alembic_config(url)
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
                conn.commit()
        except SQLAlchemyError as exc:
            raise _translate(exc, location, writing=True) from None

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
        """Record a run; a second call with the same run id (another rank) is a no-op."""
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
        except IntegrityError:
            return  # another rank recorded it between our check and insert
        except SQLAlchemyError as exc:
            raise _write_failure(exc, self.location) from None

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
        try:
            with self.engine.connect() as conn:
                for row in conn.execute(stmt):
                    run = self._run_row(row)
                    if run is not None:
                        out.append(run)
        except SQLAlchemyError as exc:
            raise _translate(exc, self.location) from None
        return out

    def _run_row(self, row: Any) -> RunRow | None:
        """One `runs` row, or None (and a line in malformed_rows) when its columns do not hold
        what a run needs: a journal damaged or written by hand is read for what it holds."""
        run_id, created_at, host, world_size, config, version, launched = row
        try:
            parsed = json.loads(config) if isinstance(config, str) else config
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            self.malformed_rows.append(f"run {run_id}: config is not a JSON object")
            parsed = {}
        if not (isinstance(run_id, str) and _is_number(created_at) and _is_int(world_size)):
            self.malformed_rows.append(
                f"run {run_id!r}: run_id, created_at or world_size of the wrong type"
            )
            return None
        return RunRow(
            run_id=run_id,
            created_at=float(created_at),
            host=str(host),
            world_size=world_size,
            config=parsed,
            lifecycle_version=str(version),
            command=launched if isinstance(launched, str) else None,
        )

    # -- events --------------------------------------------------------------------------------

    def writer(self, *, run_id: str, rank: int) -> RankWriter:
        if not self.writable:
            raise JournalError(f"{self.location}: opened read-only")
        return RankWriter(self, run_id=run_id, rank=rank)

    def read(
        self, *, run_id: str | None = None, rank: int | None = None, from_seq: int = 0
    ) -> Iterator[StoredEvent]:
        """Events in (run_id, rank, seq) order, decoded; unknown or corrupt payloads included."""
        stmt = select(
            events.c.run_id,
            events.c.rank,
            events.c.seq,
            events.c.wall_time,
            events.c.mono_ns,
            events.c.kind,
            events.c.version,
            events.c.state,
            type_coerce(events.c.data, Text),
        ).order_by(events.c.run_id, events.c.rank, events.c.seq)
        if run_id is not None:
            stmt = stmt.where(events.c.run_id == run_id)
        if rank is not None:
            stmt = stmt.where(events.c.rank == rank)
        if from_seq:
            stmt = stmt.where(events.c.seq >= from_seq)
        try:
            with self.engine.connect() as conn:
                result = conn.execution_options(yield_per=READ_CHUNK).execute(stmt)
                for chunk in result.partitions():
                    for row in chunk:
                        stored = self._stored(row)
                        if stored is not None:
                            yield stored
        except SQLAlchemyError as exc:
            raise _translate(exc, self.location) from None

    def ranks(self, run_id: str) -> list[int]:
        """The ranks that have events of `run_id` in this journal."""
        stmt = select(events.c.rank).where(events.c.run_id == run_id).distinct()
        try:
            with self.engine.connect() as conn:
                return sorted(int(r) for r in conn.execute(stmt).scalars() if _is_int(r))
        except SQLAlchemyError as exc:
            raise _translate(exc, self.location) from None

    def _stored(self, row: Any) -> StoredEvent | None:
        run_id, rank, seq, wall_time, mono_ns, kind, version, state, data = row
        if not (
            isinstance(run_id, str)
            and _is_int(rank)
            and _is_int(seq)
            and _is_number(wall_time)
            and _is_int(mono_ns)
            and isinstance(kind, str)
            and _is_int(version)
            and isinstance(state, str)
        ):
            self.malformed_rows.append(f"run {run_id!r} rank {rank!r} seq {seq!r}: bad envelope")
            return None
        try:
            payload = data if isinstance(data, str) else json.dumps(data)
        except (TypeError, ValueError, RecursionError):
            # A BLOB or worse: kept as an undecodable event, and said.
            self.malformed_rows.append(
                f"{self.location}: run {run_id} rank {rank} seq {seq}: payload is not JSON text"
            )
            payload = repr(data)[:200]
        event = decode_or_unknown(kind, version, payload)
        if isinstance(event, UnknownEvent) and event.reason != UNKNOWN_KIND:
            self.malformed_rows.append(
                f"{self.location}: run {run_id} rank {rank} seq {seq}: {kind} {event.reason}"[:300]
            )
        return StoredEvent(
            run_id=run_id,
            rank=rank,
            seq=seq,
            wall_time=float(wall_time),
            mono_ns=mono_ns,
            state=state,
            event=event,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@contextlib.contextmanager
def _creation_lock(path: Path, location: str) -> Iterator[None]:
    """Serialise journal creation between processes that open the same new file at once."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        raise JournalError(f"{location}: cannot be created: {_os_reason(exc)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class RankWriter:
    """Appends one rank's events with gapless sequence numbers, each committed before return.

    Thread-safe: the rank's main thread and its heartbeat thread share one writer.
    """

    def __init__(self, journal: Journal, *, run_id: str, rank: int) -> None:
        self.run_id = run_id
        self.rank = rank
        self._location = journal.location
        self._lock = threading.Lock()
        self._failure: JournalWriteFailed | None = None
        try:
            self._conn = journal.engine.connect()
        except SQLAlchemyError as exc:
            raise _translate(exc, self._location) from None
        dialect = journal.engine.dialect
        compiled = events.insert().compile(dialect=dialect)
        self._sql = str(compiled)
        self._positional = bool(compiled.positional)
        self._order = tuple(compiled.positiontup or ())
        try:
            existing = self._conn.execute(
                select(events.c.seq)
                .where(events.c.run_id == run_id, events.c.rank == rank)
                .limit(1)
            ).first()
            self._conn.rollback()
        except SQLAlchemyError as exc:
            self._conn.close()
            raise _translate(exc, self._location) from None
        if existing is not None:
            self._conn.close()
            raise JournalConflict(run_id=run_id, rank=rank, seq=0)
        driver = self._conn.connection.driver_connection
        self._sqlite = driver if isinstance(driver, sqlite3.Connection) else None
        self._cursor = self._sqlite.cursor() if self._sqlite is not None else None
        self._next_seq = 0
        self._closed = False
        self.write_s = 0.0  # time spent committing appends, for the shutdown record

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
            if self._failure is not None:
                # A write failed: appending past it would leave a hole that the gapless
                # sequence numbers hide, so this writer records nothing more.
                raise JournalWriteFailed(location=self._location, reason=self._failure.reason)
            if self._closed:
                raise JournalError(f"{self._location}: writer for rank {self.rank} is closed")
            first = self._next_seq
            rows: list[Any] = []
            stored = []
            for offset, ((event, state, wall_time, mono_ns), payload) in enumerate(
                zip(items, payloads, strict=True)
            ):
                row = (self.run_id, self.rank, first + offset, wall_time, mono_ns, event.kind,
                       event.version, state, payload)  # fmt: skip
                if self._positional and self._order == _COLUMN_ORDER:
                    rows.append(row)
                else:
                    values = dict(zip(_COLUMN_ORDER, row, strict=True))
                    rows.append(
                        tuple(values[k] for k in self._order) if self._positional else values
                    )
                stored.append(
                    StoredEvent(
                        run_id=self.run_id,
                        rank=self.rank,
                        seq=first + offset,
                        wall_time=wall_time,
                        mono_ns=mono_ns,
                        state=state,
                        event=event,
                    )
                )
            started = time.perf_counter()
            self._insert(rows, first)
            self.write_s += time.perf_counter() - started
            self._next_seq = first + len(rows)
        return stored

    def _insert(self, rows: list[Any], seq: int) -> None:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                if self._sqlite is not None:
                    self._insert_sqlite(rows)
                else:
                    self._conn.exec_driver_sql(self._sql, rows if len(rows) > 1 else rows[0])
                    self._conn.commit()
                return
            except IntegrityError as exc:
                self._conn.rollback()
                if "UNIQUE" in str(exc.orig) or "PRIMARY" in str(exc.orig).upper():
                    raise JournalConflict(run_id=self.run_id, rank=self.rank, seq=seq) from None
                raise _translate(exc, self._location) from None
            except OperationalError as exc:
                self._rollback()
                if "locked" in str(exc.orig) and attempt < LOCKED_RETRIES:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise self._failed(exc) from None
            except DBAPIError as exc:
                self._rollback()
                raise self._failed(exc) from None
            except sqlite3.IntegrityError as exc:
                self._rollback_sqlite()
                if "UNIQUE" in str(exc):
                    raise JournalConflict(run_id=self.run_id, rank=self.rank, seq=seq) from None
                raise JournalError(f"{self._location}: {exc}") from None
            except sqlite3.OperationalError as exc:
                self._rollback_sqlite()
                if "locked" in str(exc) and attempt < LOCKED_RETRIES:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise self._failed(exc) from None
            except sqlite3.Error as exc:
                self._rollback_sqlite()
                raise self._failed(exc) from None

    def _failed(self, exc: Exception) -> JournalError:
        failure = _write_failure(exc, self._location)
        if isinstance(failure, JournalWriteFailed):
            self._failure = failure
        return failure

    def _rollback(self) -> None:
        # After a disk error the rollback may fail too; the write's own error is the one to tell.
        with contextlib.suppress(SQLAlchemyError):
            self._conn.rollback()

    def _insert_sqlite(self, rows: list[Any]) -> None:
        # The hot path: one append is BEGIN IMMEDIATE, INSERT, COMMIT on the driver connection
        # that SQLAlchemy opened, without the per-statement cost of its execution layer.
        assert self._cursor is not None
        cur = self._cursor
        cur.execute("BEGIN IMMEDIATE")
        if len(rows) == 1:
            cur.execute(self._sql, rows[0])
        else:
            cur.executemany(self._sql, rows)
        cur.execute("COMMIT")

    def _rollback_sqlite(self) -> None:
        if self._sqlite is not None and self._sqlite.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._sqlite.execute("ROLLBACK")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._cursor is not None:
                    self._cursor.close()
                self._conn.close()


def journal_revision(location: str) -> str:
    """The schema revision of an existing journal, read without writing to it."""
    shown = shown_location(location)
    url = to_url(location)
    path = _sqlite_path(url, shown)
    if path is not None:
        if _stat(path, shown) is None:
            raise JournalNotFound(location=shown)
        if _check_sqlite_file(path, shown):
            return EMPTY
        engine = _sqlite_engine(path, write=False)
    else:
        engine = _url_engine(url, shown)
    try:
        with engine.connect() as conn:
            return _schema_revision(conn, shown)
    except SQLAlchemyError as exc:
        raise _translate(exc, shown) from None
    finally:
        engine.dispose()
