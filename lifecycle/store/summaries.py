"""The per run-and-rank summary rows: what they hold, reading them, and filling them in.

A writer keeps its rank's row current in the transaction of every append (see RankWriter);
`backfill` computes the rows of a journal written before revision 0003 from its events.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, literal, select, tuple_

from lifecycle.core.errors import CorruptEvent
from lifecycle.core.format.checkpoint import FOLD_VERSION, checkpoint, restore
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.states import TERMINAL_STATES, State
from lifecycle.store.backends.schema import events, rank_checkpoints, rank_summaries
from lifecycle.store.decode import DATA_ERRORS
from lifecycle.store.rows import is_int, is_number

SUMMARY_REVISION = "0003"  # the first revision with rank_summaries
BACKFILL_BATCH = 200  # summary rows inserted per transaction by `backfill`


# The columns a writer updates with every append (all of rank_summaries but its key).
SUMMARY_COLUMNS = (
    "last_seq", "events", "state", "first_wall", "last_wall", "last_heartbeat_wall", "path",
    "first_error", "ready_at", "healthy", "ended", "planned", "calibrated", "skip_reason",
    "host",
)  # fmt: skip


def summary_values(fold: RankFold) -> dict[str, Any]:
    """A summary row's columns for `fold`."""
    fatal = next((e for _, _, e in fold.errors if e.fatal), None)
    values: dict[str, Any] = {
        "last_seq": fold.last_seq,
        "events": fold.events,
        "state": fold.state,
        "first_wall": fold.first_wall,
        "last_wall": fold.last_wall,
        "last_heartbeat_wall": fold.last_heartbeat_wall,
        "path": " ".join(fold.path),
        "first_error": f"{fatal.error_kind}: {fatal.message}"[:500] if fatal else None,
        "ready_at": next((s.entered_at for s in fold.spans if s.state == State.READY), None),
        "healthy": fold.ready_action_done,
        "ended": fold.shutdown is not None or fold.state == State.STOPPED,
        "planned": fold.plan is not None,
        "calibrated": State.PROBE in fold.path,
        "skip_reason": fold.plan.skip_reason if fold.plan is not None else None,
        "host": fold.run_started.host[:255] if fold.run_started is not None else None,
    }
    return values


def checkpoint_values(fold: RankFold) -> dict[str, Any]:
    """A checkpoint row's columns for `fold`."""
    return {"fold_version": FOLD_VERSION, "fold_seq": fold.last_seq, "fold": checkpoint(fold)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Summary:
    """One rank's summary row and its checkpoint, as far as a reader needs them."""

    run_id: str
    rank: int
    last_seq: int
    state: str
    ready_at: float | None
    healthy: bool
    ended: bool
    planned: bool
    calibrated: bool
    skip_reason: str | None
    host: str | None
    fold_version: int | None  # None without a checkpoint row
    fold_seq: int
    fold: str
    # Its latest heartbeat, which after ready is kept here in place rather than journaled
    # (see RankWriter.beat): at least the last heartbeat event's time.
    last_heartbeat_wall: float | None = None

    def restored(self) -> RankFold | None:
        """The fold its checkpoint holds, if it is one this lifecycle reads and whole (this
        row's run and rank, at its `fold_seq`); None otherwise, and the reader folds the rank's
        events instead."""
        if self.fold_version != FOLD_VERSION:
            return None
        try:
            fold = restore(self.fold)
        except (CorruptEvent, *DATA_ERRORS):
            return None
        if (fold.run_id, fold.rank, fold.last_seq) != (self.run_id, self.rank, self.fold_seq):
            return None
        return fold


def read_summaries(
    conn: Connection, run_ids: Iterable[str] | None = None, *, checkpoints: bool = True
) -> list[Summary]:
    """The summary rows of the given runs (of every run when None), with their checkpoints
    unless `checkpoints` is false."""
    c, k = rank_summaries.c, rank_checkpoints.c
    stmt = select(
        c.run_id,
        c.rank,
        c.last_seq,
        c.state,
        c.ready_at,
        c.healthy,
        c.ended,
        c.planned,
        c.calibrated,
        c.skip_reason,
        c.host,
        c.last_heartbeat_wall,
        k.fold_version,
        k.fold_seq,
        k.fold,
    ).join(
        rank_checkpoints,
        (k.run_id == c.run_id) & (k.rank == c.rank) & literal(checkpoints),
        isouter=True,
    )
    if run_ids is not None:
        stmt = stmt.where(c.run_id.in_(list(run_ids)))
    found = (_summary(row) for row in conn.execute(stmt.order_by(c.run_id, c.rank)))
    return [summary for summary in found if summary is not None]


def _summary(row: Any) -> Summary | None:
    """A summary row as read, checked; None for a damaged one (that rank is folded from its
    events instead)."""
    (run_id, rank, last_seq, state, ready_at, healthy, ended, planned, calibrated, skip,
     host, beat, version, fold_seq, fold) = row  # fmt: skip
    if not (isinstance(run_id, str) and is_int(rank) and is_int(last_seq)):
        return None
    flags = (healthy, ended, planned, calibrated)
    if not all(f in (0, 1) for f in flags) or not isinstance(ready_at, float | None):
        healthy = ended = False  # not a settled run: judged from its fold instead
        ready_at = None
    if not (is_int(version) and is_int(fold_seq) and isinstance(fold, str)):
        version, fold_seq, fold = None, -1, ""
    return Summary(
        run_id=run_id,
        rank=rank,
        last_seq=last_seq,
        state=str(state),
        ready_at=ready_at,
        healthy=bool(healthy),
        ended=bool(ended),
        planned=bool(planned),
        calibrated=bool(calibrated),
        skip_reason=skip if isinstance(skip, str) else None,
        host=host if isinstance(host, str) else None,
        fold_version=version,
        fold_seq=fold_seq,
        fold=fold,
        last_heartbeat_wall=float(beat) if is_number(beat) else None,
    )


def with_latest_heartbeat(fold: RankFold, wall: float | None) -> None:
    """Move `fold` on to the heartbeat its summary row holds (`wall`), as a journaled heartbeat
    at that time would have moved it: after ready a rank's beats live in that row, and its
    events alone would read an idle server as silent. A rank that journaled its end is left
    as its events say: it beat no more after that, and its view stays the full fold's."""
    if wall is None or fold.shutdown is not None or fold.state in TERMINAL_STATES:
        return
    if fold.last_heartbeat_wall is not None and wall <= fold.last_heartbeat_wall:
        return
    fold.last_heartbeat_wall = wall
    fold.recent_heartbeats.append(wall)
    fold.last_wall = wall if fold.last_wall is None else max(fold.last_wall, wall)


def missing_summaries(conn: Connection) -> list[tuple[str, int]]:
    """The (run, rank) pairs that have events and no summary row."""
    have = select(rank_summaries.c.run_id, rank_summaries.c.rank)
    stmt = (
        select(events.c.run_id, events.c.rank)
        .where(tuple_(events.c.run_id, events.c.rank).not_in(have))
        .distinct()
        .order_by(events.c.run_id, events.c.rank)
    )
    return [(str(r), int(k)) for r, k in conn.execute(stmt)]


def backfill(
    conn: Connection, read: Any, *, pairs: list[tuple[str, int]] | None = None
) -> Iterator[tuple[str, int]]:
    """Fold each (run, rank) without a summary row and insert its row, BACKFILL_BATCH rows a
    transaction; `read(run_id, rank)` yields that rank's events in seq order. Yields each pair
    as it is filled in."""
    todo = missing_summaries(conn) if pairs is None else pairs
    conn.rollback()
    for start in range(0, len(todo), BACKFILL_BATCH):
        rows, checkpoints = [], []
        for run_id, rank in todo[start : start + BACKFILL_BATCH]:
            fold = RankFold(run_id=run_id, rank=rank)
            stored: StoredEvent
            for stored in read(run_id, rank):
                fold.apply(stored)
            rows.append({"run_id": run_id, "rank": rank, **summary_values(fold)})
            checkpoints.append({"run_id": run_id, "rank": rank, **checkpoint_values(fold)})
        with conn.begin():
            conn.execute(rank_summaries.insert(), rows)
            conn.execute(rank_checkpoints.insert(), checkpoints)
        yield from ((r["run_id"], r["rank"]) for r in rows)
