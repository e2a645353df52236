"""The weight keepers' life in the journal (the `keeper_log` table): rows appended as a keeper
lives, read back newest first, and what a keeper that started finds of the one before it."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, insert, select

from lifecycle.store.backends.dberrors import DATABASE_ERRORS, journal_error
from lifecycle.store.backends.schema import keeper_log
from lifecycle.store.journal import Journal

STARTED = "started"
STOPPED = "stopped"


@dataclass(frozen=True, slots=True, kw_only=True)
class KeeperRow:
    """One thing that happened to a keeper."""

    host: str
    keeper_pid: int
    wall: float
    what: str
    key: str | None = None
    bytes: int = 0
    detail: str | None = None


def append_keeper_rows(journal: Journal, rows: list[KeeperRow]) -> None:
    """Journal `rows`, in one transaction."""
    if not rows:
        return
    values = [
        {
            "host": r.host,
            "keeper_pid": r.keeper_pid,
            "wall": r.wall,
            "what": r.what,
            "key": r.key,
            "bytes": r.bytes,
            "detail": r.detail,
        }
        for r in rows
    ]
    try:
        with journal.engine.begin() as conn:
            conn.execute(insert(keeper_log), values)
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True) from None


def keeper_rows(journal: Journal, *, host: str | None = None, limit: int = 200) -> list[KeeperRow]:
    """The newest `limit` rows (of `host`'s keepers where given), newest first."""
    c = keeper_log.c
    stmt = select(c.host, c.keeper_pid, c.wall, c.what, c.key, c.bytes, c.detail)
    if host is not None:
        stmt = stmt.where(c.host == host)
    stmt = stmt.order_by(c.wall.desc(), c.id.desc()).limit(limit)
    try:
        with journal.engine.connect() as conn:
            found = conn.execute(stmt).all()
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location) from None
    return [
        KeeperRow(
            host=str(r.host),
            keeper_pid=int(r.keeper_pid),
            wall=float(r.wall),
            what=str(r.what),
            key=r.key,
            bytes=int(r.bytes),
            detail=r.detail,
        )
        for r in found
    ]


def previous_keeper(journal: Journal, *, host: str, pid: int) -> tuple[KeeperRow, int] | None:
    """The keeper of `host` before this one (`pid`), when it ended without stopping: its last
    row and how many keys it held then (what is lost with it)."""
    rows = [r for r in keeper_rows(journal, host=host, limit=500) if r.keeper_pid != pid]
    if not rows or rows[0].what == STOPPED:
        return None
    last = rows[0]
    held: set[str] = set()
    for row in reversed([r for r in rows if r.keeper_pid == last.keeper_pid]):
        if row.what == "holds" and row.key:
            held.add(row.key)
        elif row.what in ("evicted", "dropped") and row.key:
            held.discard(row.key)
        elif row.what == STARTED:
            held.clear()
    return last, len(held)


def prune_keeper_rows(journal: Journal, *, before: float) -> int:
    """Remove rows older than `before` (seconds since the epoch): how many."""
    try:
        with journal.engine.begin() as conn:
            result = conn.execute(delete(keeper_log).where(keeper_log.c.wall < before))
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True) from None
    return int(result.rowcount or 0)
