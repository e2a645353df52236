"""What the traffic of a fingerprint asked for: the requests its newest healthy runs served
(rank 0's), with their shapes, steps and times, read through the startup history's index and
the events' (run_id, kind) index, bounded however long the journal has served."""

from __future__ import annotations

from sqlalchemy import Connection, select

from lifecycle.core.decisions.deadlines import StartupPath, history_key
from lifecycle.core.decisions.learnedshapes import LEARN_REQUESTS_PER_RUN, LEARN_RUNS, Served
from lifecycle.core.format.events import RequestFinished, RequestStarted
from lifecycle.store.backends.schema import events, startup_history
from lifecycle.store.decode import EVENT_ROW, decode_row

SERVED_SOURCE = "http"


def fingerprint_runs(conn: Connection, fingerprint_key: str) -> list[tuple[str, float | None]]:
    """The newest LEARN_RUNS runs of the fingerprint that reached ready (any path), newest
    first, each with rank 0's start-to-ready seconds where known."""
    c = startup_history.c
    keys = [history_key(fingerprint_key, path) for path in StartupPath]
    rows = conn.execute(
        select(c.run_id, c.process_ready_s)
        .where(c.key.in_(keys), c.rank == 0)
        .order_by(c.ready_wall.desc())
        .limit(LEARN_RUNS)
    ).all()
    return [
        (str(run_id), float(ready) if isinstance(ready, int | float) else None)
        for run_id, ready in rows
    ]


def served_requests(conn: Connection, run_ids: list[str], location: str) -> list[Served]:
    """The requests rank 0 of each run served over HTTP and finished well (of the newest
    LEARN_REQUESTS_PER_RUN of each), with their seconds: one that never finished (it stalled,
    failed or was cancelled) is not learned. Rows that do not decode are left out."""
    served: list[Served] = []
    for run_id in run_ids:
        stmt = (
            EVENT_ROW.where(
                events.c.run_id == run_id,
                events.c.rank == 0,
                events.c.kind.in_((RequestStarted.kind, RequestFinished.kind)),
            )
            .order_by(events.c.seq.desc())
            .limit(2 * LEARN_REQUESTS_PER_RUN)
        )
        started: dict[str, RequestStarted] = {}
        seconds: dict[str, float] = {}
        for row in conn.execute(stmt):
            stored, _ = decode_row(tuple(row), location)
            event = None if stored is None else stored.event
            if isinstance(event, RequestStarted) and event.source == SERVED_SOURCE:
                started[event.request_id] = event
            elif isinstance(event, RequestFinished) and event.ok:
                seconds[event.request_id] = event.total_s
        served += [
            Served(shape=e.shape, steps=e.steps, seconds=seconds[request_id])
            for request_id, e in started.items()
            if request_id in seconds
        ]
    return served
