"""The statements a rank's writer runs, compiled once a process for each driver: the event
insert, and the inserts and updates of its summary, checkpoint and startup-history rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Dialect, Table, bindparam
from sqlalchemy.sql.expression import ClauseElement

from lifecycle.store.backends.schema import (
    events,
    rank_checkpoints,
    rank_summaries,
    startup_history,
)
from lifecycle.store.summaries import SUMMARY_COLUMNS

_CHECKPOINT = ("fold_version", "fold_seq", "fold")


class Statement:
    """A statement compiled once for the driver, and its parameters in the driver's form."""

    def __init__(self, statement: ClauseElement, dialect: Dialect) -> None:
        compiled: Any = statement.compile(dialect=dialect)
        self.sql = str(compiled)
        self._order = tuple(compiled.positiontup or ()) if compiled.positional else None

    def params(self, values: dict[str, Any]) -> Any:
        return values if self._order is None else tuple(values[k] for k in self._order)


def _summary_update(table: Table, columns: tuple[str, ...], dialect: Dialect) -> Statement:
    stmt = (
        table.update()
        .where(table.c.run_id == bindparam("key_run_id"), table.c.rank == bindparam("key_rank"))
        .values({c: bindparam(c) for c in columns})
    )
    return Statement(stmt, dialect)


@dataclass(frozen=True, slots=True)
class Statements:
    """Every statement a writer runs, compiled for one driver: once a process, not once a
    writer (compiling them took most of opening a writer)."""

    events_insert: str
    events_positional: bool
    events_order: tuple[str, ...]
    summary_insert: Statement
    summary_update: Statement
    checkpoint_insert: Statement
    checkpoint_update: Statement
    history_insert: Statement
    beat_update: Statement


_COMPILED: dict[tuple[str, str, str], Statements] = {}


def statements_for(dialect: Dialect) -> Statements:
    key = (dialect.name, str(dialect.driver), str(dialect.paramstyle))
    found = _COMPILED.get(key)
    if found is None:
        compiled = events.insert().compile(dialect=dialect)
        found = _COMPILED[key] = Statements(
            events_insert=str(compiled),
            events_positional=bool(compiled.positional),
            events_order=tuple(compiled.positiontup or ()),
            summary_insert=Statement(rank_summaries.insert(), dialect),
            summary_update=_summary_update(rank_summaries, SUMMARY_COLUMNS, dialect),
            checkpoint_insert=Statement(rank_checkpoints.insert(), dialect),
            checkpoint_update=_summary_update(rank_checkpoints, _CHECKPOINT, dialect),
            history_insert=Statement(startup_history.insert(), dialect),
            beat_update=_summary_update(rank_summaries, ("last_heartbeat_wall",), dialect),
        )
    return found
