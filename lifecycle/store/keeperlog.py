"""The weight keepers' life in the journal (the `keeper_log` table): rows appended as a keeper
lives, read back newest first, and what a keeper that started finds of the one before it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, delete, insert, select

from lifecycle.store.backends.dberrors import DATABASE_ERRORS, journal_error
from lifecycle.store.backends.schema import keeper_log
from lifecycle.store.journal import Journal

STARTED = "started"
STOPPED = "stopped"
_LIFE_LIMIT = 100_000  # rows of one keeper's life read back (a life of months is fewer)
_C = keeper_log.c
_ROW = select(_C.host, _C.keeper_pid, _C.wall, _C.what, _C.key, _C.bytes, _C.detail)


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
    stmt = _ROW.where(c.host == host) if host is not None else _ROW
    return _rows(journal, stmt.order_by(c.wall.desc(), c.id.desc()).limit(limit))


def started_detail(socket: str) -> str:
    """The `started` row's detail: the socket the keeper listens on, which names the keeper
    across its lives (a pid does not: a sidecar's keeper is pid 1 in every life)."""
    return f"socket {socket}"


def previous_keeper(journal: Journal, *, host: str, socket: str) -> tuple[KeeperRow, int] | None:
    """The keeper that listened on `socket` of `host` before this one, when it ended without
    stopping: its last row and how many keys it held then (what is lost with it). Called before
    this keeper journals its start; a keeper of another socket, alive or not, is not this one's
    predecessor."""
    c = keeper_log.c
    latest = (
        select(c.id, c.keeper_pid)
        .where(c.host == host, c.what == STARTED, c.detail == started_detail(socket))
        .order_by(c.wall.desc(), c.id.desc())
        .limit(1)
    )
    try:
        with journal.engine.connect() as conn:
            start = conn.execute(latest).first()
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location) from None
    if start is None:
        return None
    since = _ROW.where(c.host == host, c.keeper_pid == start.keeper_pid, c.id >= start.id)
    life = _rows(journal, since.order_by(c.id).limit(_LIFE_LIMIT))
    held: set[str] = set()
    last = life[0]
    for n, row in enumerate(life):
        if row.what == STARTED and n > 0:
            break  # the same pid started again, on another socket: that life is another's
        last = row
        if row.what == "holds" and row.key:
            held.add(row.key)
        elif row.what in ("evicted", "dropped") and row.key:
            held.discard(row.key)
    if last.what == STOPPED:
        return None
    return last, len(held)


def _rows(journal: Journal, stmt: Select[Any]) -> list[KeeperRow]:
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


def prune_keeper_rows(journal: Journal, *, before: float) -> int:
    """Remove rows older than `before` (seconds since the epoch): how many."""
    try:
        with journal.engine.begin() as conn:
            result = conn.execute(delete(keeper_log).where(keeper_log.c.wall < before))
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, journal.location, writing=True) from None
    return int(result.rowcount or 0)
