"""The one boundary where database errors become journal errors, by error code, never by text."""

from __future__ import annotations

import enum
import sqlite3

from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    NoSuchModuleError,
    OperationalError,
    SQLAlchemyError,
)

from lifecycle.core.command import extra
from lifecycle.core.errors import (
    JournalConflict,
    JournalError,
    JournalNotFound,
    JournalWriteFailed,
    NotAJournal,
)

# What a store operation may raise: SQLAlchemy's wrappers, and sqlite3's own errors from the
# append path that runs on the driver connection.
DATABASE_ERRORS: tuple[type[Exception], ...] = (SQLAlchemyError, sqlite3.Error)


class Fault(enum.Enum):
    """What went wrong in the database, whichever driver said it and in whatever language."""

    DUPLICATE_KEY = "duplicate key"
    CONSTRAINT = "constraint"
    DISK_FULL = "disk full"
    IO = "I/O error"
    READ_ONLY = "read-only"
    BUSY = "busy"  # locked or a serialisation failure: the same statement may succeed again
    CORRUPT = "corrupt"
    MISSING_DATABASE = "missing database"
    AUTHENTICATION = "authentication"
    PRIVILEGE = "privilege"
    CONNECTION = "connection"
    OTHER = "other"


# SQLite: extended result codes where the primary one is too coarse, then primary codes
# (`sqlite_errorcode & 0xFF`).
_SQLITE_EXTENDED = {
    sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY: Fault.DUPLICATE_KEY,
    sqlite3.SQLITE_CONSTRAINT_UNIQUE: Fault.DUPLICATE_KEY,
}
_SQLITE_PRIMARY = {
    sqlite3.SQLITE_CONSTRAINT: Fault.CONSTRAINT,
    sqlite3.SQLITE_FULL: Fault.DISK_FULL,
    sqlite3.SQLITE_IOERR: Fault.IO,
    sqlite3.SQLITE_READONLY: Fault.READ_ONLY,
    sqlite3.SQLITE_BUSY: Fault.BUSY,
    sqlite3.SQLITE_LOCKED: Fault.BUSY,
    sqlite3.SQLITE_NOTADB: Fault.CORRUPT,
    sqlite3.SQLITE_CORRUPT: Fault.CORRUPT,
}
# SQLSTATE (PostgreSQL, and any server that reports it): exact codes first, then classes.
_SQLSTATE = {
    "23505": Fault.DUPLICATE_KEY,  # unique_violation
    "53100": Fault.DISK_FULL,  # disk_full
    "58030": Fault.IO,  # io_error
    "25006": Fault.READ_ONLY,  # read_only_sql_transaction
    "40001": Fault.BUSY,  # serialization_failure
    "40P01": Fault.BUSY,  # deadlock_detected
    "55P03": Fault.BUSY,  # lock_not_available
    "28P01": Fault.AUTHENTICATION,  # invalid_password
    "28000": Fault.AUTHENTICATION,  # invalid_authorization_specification
    "3D000": Fault.MISSING_DATABASE,  # invalid_catalog_name
    "42501": Fault.PRIVILEGE,  # insufficient_privilege
    "XX001": Fault.CORRUPT,  # data_corrupted
    "XX002": Fault.CORRUPT,  # index_corrupted
}
_SQLSTATE_CLASSES = {
    "23": Fault.CONSTRAINT,  # integrity constraint violation
    "08": Fault.CONNECTION,  # connection exception
    "57": Fault.CONNECTION,  # operator intervention: the server is shutting down
}

# The faults that mean the disk refused a write: while writing, the record is incomplete.
_DISK_FAULTS = frozenset({Fault.DISK_FULL, Fault.IO})


def _cause(exc: BaseException) -> BaseException:
    """The driver's exception under SQLAlchemy's wrapper, where there is one."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE a driver attached: psycopg 3 `sqlstate`, psycopg2 `pgcode`."""
    cause = _cause(exc)
    for attribute in ("sqlstate", "pgcode"):
        state = getattr(cause, attribute, None)
        if isinstance(state, str) and len(state) == 5:
            return state
    return None


def fault_of(exc: BaseException) -> Fault:
    """Classify a database error by the driver's code: SQLite result codes, or SQLSTATE."""
    cause = _cause(exc)
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        if isinstance(code, int):
            return _SQLITE_EXTENDED.get(code) or _SQLITE_PRIMARY.get(code & 0xFF, Fault.OTHER)
    state = sqlstate(exc)
    if state is not None:
        return _SQLSTATE.get(state) or _SQLSTATE_CLASSES.get(state[:2], Fault.OTHER)
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return Fault.CONNECTION
    if isinstance(exc, OperationalError):
        # A server's driver raises PEP 249's OperationalError with no SQLSTATE when the
        # connection itself failed: refused, reset, or closed by a server going away
        # (SQLite's have a result code, read above).
        return Fault.CONNECTION
    if isinstance(exc, IntegrityError | sqlite3.IntegrityError):
        # A driver that reports no code: which constraint failed is unknown, and only a known
        # duplicate key may be called a second writer.
        return Fault.CONSTRAINT
    return Fault.OTHER


def is_retryable(exc: BaseException) -> bool:
    """True when the same statement may succeed if run again (a lock, a serialisation
    failure); the busy timeout has already waited inside the driver."""
    return fault_of(exc) is Fault.BUSY


def message_of(exc: BaseException) -> str:
    """The first line of what the database said, for a person to read."""
    cause = _cause(exc)
    lines = str(cause).strip().splitlines()
    return lines[0] if lines else type(cause).__name__


def journal_error(
    exc: BaseException, location: str, *, writing: bool = False, opened: bool = False
) -> JournalError:
    """A database error as a journal error; one the disk raised while `writing` is a failed
    write (exit 3), not bad input.

    `opened`: the journal opened fine before. A server that then refuses or drops the
    connection (stopped, shut down by its administrator, crashed) went away under the ranks
    appending to it: the journal could not be written (exit 3), as with a full disk; before it
    opened, the same refusal is an unreachable server, bad input (exit 2).
    """
    fault = fault_of(exc)
    message = message_of(exc)
    if fault is Fault.CORRUPT:
        return NotAJournal(location=location, reason=f"corrupt database ({message})")
    if fault is Fault.MISSING_DATABASE:
        return JournalNotFound(location=location)
    if (writing and fault in _DISK_FAULTS) or (opened and fault is Fault.CONNECTION):
        return JournalWriteFailed(location=location, reason=message)
    return JournalError(f"{location}: {message}")


def write_failure(exc: BaseException, location: str) -> JournalError:
    """A failed write to a journal that opened fine: the record is incomplete from here on,
    whatever the database said (disk full, I/O error, locked past the busy timeout, a lost
    connection); a corrupt database is still said to be one."""
    if fault_of(exc) is Fault.CORRUPT:
        return journal_error(exc, location)
    return JournalWriteFailed(location=location, reason=message_of(exc))


def append_error(
    exc: BaseException, *, location: str, run_id: str, rank: int, seq: int
) -> JournalError:
    """An append that failed: a duplicate key is a second writer for the rank, another
    constraint is a bad event (the writer may go on), anything else is a failed write."""
    fault = fault_of(exc)
    if fault is Fault.DUPLICATE_KEY:
        return JournalConflict(run_id=run_id, rank=rank, seq=seq)
    if fault is Fault.CONSTRAINT:
        return JournalError(f"{location}: {message_of(exc)}")
    return write_failure(exc, location)


# The pip package that provides a database driver module, where the two names differ.
DRIVER_PACKAGES = {
    "psycopg": extra("postgres"),
    "psycopg2": "psycopg2-binary",
    "pymysql": "PyMySQL",
    "MySQLdb": "mysqlclient",
    "cx_Oracle": "cx-Oracle",
}


def engine_error(exc: Exception, location: str, drivername: str) -> JournalError:
    """A database URL that no engine can be made for: an unknown dialect, a driver that is
    not installed (with the command that installs it), or arguments the dialect refuses."""
    if isinstance(exc, NoSuchModuleError):
        return JournalError(
            f"{location}: no database dialect {drivername!r} is installed"
            " (a journal is a file path, or a URL such as postgresql+psycopg://HOST/DB)"
        )
    if isinstance(exc, ImportError):
        module = (exc.name or "").split(".")[0]
        if not module:
            return JournalError(f"{location}: the database driver cannot be loaded ({exc})")
        package = DRIVER_PACKAGES.get(module, module)
        return JournalError(
            f"{location}: the database driver {module!r} for {drivername!r} is not"
            f" installed: pip install '{package}'"
        )
    if isinstance(exc, ArgumentError):
        return JournalError(f"{location}: not a usable database URL ({message_of(exc)})")
    return journal_error(exc, location)
