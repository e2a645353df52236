"""A weights key's reference output on a rank: the newest `reference_output` the journal's
recent runs hold for it, read through the events' (run_id, kind) index and bounded however
long the journal has served (a run that verified against it journals it again, so it stays
among the recent ones)."""

from __future__ import annotations

from sqlalchemy import Connection, select

from lifecycle.core.format.events import ReferenceOutput
from lifecycle.store.backends.schema import events, runs
from lifecycle.store.decode import EVENT_ROW, decode_row

REFERENCE_RUNS = 64


def reference_output(
    conn: Connection, reference_key: str, *, rank: int, location: str
) -> tuple[str, str] | None:
    """The reference checksum of `reference_key` on `rank` and the run that first journaled
    it; None where the recent runs hold none."""
    recent = select(runs.c.run_id).order_by(runs.c.created_at.desc()).limit(REFERENCE_RUNS)
    stmt = EVENT_ROW.where(
        events.c.run_id.in_(recent.scalar_subquery()),
        events.c.rank == rank,
        events.c.kind == ReferenceOutput.kind,
    ).order_by(events.c.wall_time.desc())
    for row in conn.execute(stmt):
        stored, _ = decode_row(tuple(row), location)
        event = None if stored is None else stored.event
        if isinstance(event, ReferenceOutput) and event.key == reference_key:
            return event.checksum, event.since_run or stored.run_id  # type: ignore[union-attr]
    return None
