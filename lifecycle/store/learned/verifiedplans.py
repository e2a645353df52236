"""Reading the residency events that a later startup decides reuse from: the newest runs of a
model, then their residency events through the (run_id, kind) index, newest first."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, select

from lifecycle.core.format.events import StoredEvent, UnknownEvent
from lifecycle.store.backends.schema import events, runs
from lifecycle.store.decode import EVENT_ROW, decode_row
from lifecycle.store.rows import json_column

RESIDENCY_KINDS = (
    "residency_planned",
    "residency_applied",
    "residency_verified",
    "residency_rolled_back",
)
# Runs looked at, newest first: a plan older than this many runs is calibrated again.
HISTORY_RUNS = 200


def residency_history(
    conn: Connection, model: str, *, runs_back: int = HISTORY_RUNS
) -> list[StoredEvent]:
    """Rank 0's residency events of the newest `runs_back` runs of `model`, newest first
    (rows that do not decode are left out)."""
    recent = conn.execute(
        select(runs.c.run_id, runs.c.config).order_by(runs.c.created_at.desc()).limit(runs_back)
    ).all()
    run_ids = [run_id for run_id, config in recent if _model_of(config) == model]
    if not run_ids:
        return []
    rows = conn.execute(
        EVENT_ROW.where(
            events.c.run_id.in_(run_ids),
            events.c.kind.in_(RESIDENCY_KINDS),
            events.c.rank == 0,
        ).order_by(events.c.wall_time.desc(), events.c.seq.desc())
    ).all()
    decoded = (decode_row(row, "")[0] for row in rows)
    return [s for s in decoded if s is not None and not isinstance(s.event, UnknownEvent)]


def planned_inputs(conn: Connection, run_id: str) -> list[StoredEvent]:
    """Every rank's `residency_planned` events of one run, in rank order: what its plan is
    decided again from before a later startup reuses it."""
    rows = conn.execute(
        EVENT_ROW.where(events.c.run_id == run_id, events.c.kind == "residency_planned").order_by(
            events.c.rank, events.c.seq
        )
    ).all()
    decoded = (decode_row(row, "")[0] for row in rows)
    return [s for s in decoded if s is not None and not isinstance(s.event, UnknownEvent)]


def _model_of(config: Any) -> str | None:
    if isinstance(config, str):
        config = json_column(config)
    model = config.get("model") if isinstance(config, dict) else None
    name = model.get("name") if isinstance(model, dict) else None
    return name if isinstance(name, str) else None
