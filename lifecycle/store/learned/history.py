"""The startup history: each healthy rank's time in each state, written with the append that
finished its ready action, and read back by key (a startup at gate-check) or whole (`replay
history`), never from the events; and beside it the gate's probe figures of each run, which are
read from their own events through the index on (run_id, kind)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, select

from lifecycle.core.decisions.deadlines import (
    SAMPLE_RUNS,
    RankDurations,
    durations_before_ready,
    load_key,
)
from lifecycle.core.format.events import LoadFinished, RankProbed, StoredEvent, WeightsPath
from lifecycle.core.format.fold import MAX_CLOCK_OFFSET_S, RankFold
from lifecycle.core.format.states import State
from lifecycle.store.backends.dberrors import DATABASE_ERRORS, journal_error
from lifecycle.store.backends.schema import KNOWN_REVISIONS, events, startup_history
from lifecycle.store.decode import EVENT_ROW, decode_row
from lifecycle.store.rows import is_int, is_number, json_column

HISTORY_REVISION = "0004"
# Runs per query of their probe figures: well under any database's limit on bound parameters.
PROBE_RUNS_PER_QUERY = 500
# A row's state durations: a few dozen states' names and seconds, far below this.
MAX_DURATIONS_CHARS = 64 * 1024  # the first revision with startup_history


def history_values(fold: RankFold) -> dict[str, Any] | None:
    """The history row of a rank whose ready action has just finished, from its fold; None
    when it journaled no history key at gate-check (a startup that never got that far, or one
    written by a lifecycle before the history)."""
    expected = fold.expectations
    ready_wall = next((s.entered_at for s in fold.spans if s.state == State.READY), None)
    if not fold.ready_action_done or expected is None or ready_wall is None:
        return None
    return {
        "key": expected.key[:64],
        "ready_wall": ready_wall,
        "process_ready_s": _process_ready_s(fold, ready_wall),
        "durations": json.dumps({**dict(durations_before_ready(fold.spans)), **_loads(fold)}),
    }


def _loads(fold: RankFold) -> dict[str, float]:
    """Each component's load that ended well, by its history name (`load NAME`), and the
    weights' path at gate-check (`load weights (attach)` or `load weights (load)`)."""
    loads = {
        load_key(event.component): event.seconds
        for _, _, event in fold.loads
        if isinstance(event, LoadFinished) and event.ok
    }
    path = next((e for _, _, e in fold.compiles if isinstance(e, WeightsPath)), None)
    if path is not None:
        loads[load_key(f"weights ({path.path})")] = path.seconds
    return loads


def _process_ready_s(fold: RankFold, ready_wall: float) -> float | None:
    """Seconds from the rank's process start to its ready, both on rank 0's clock, when its
    `run_started` says when the process started."""
    began = fold.run_started.process_started_wall if fold.run_started is not None else None
    if began is None or not math.isfinite(began):
        return None
    offset = fold.clock.offset_s if fold.clock is not None else 0.0
    if abs(offset) <= MAX_CLOCK_OFFSET_S:
        began -= offset
    seconds = ready_wall - began
    return seconds if 0.0 <= seconds < math.inf else None


@dataclass(frozen=True, slots=True)
class HistoryRead:
    """History rows as read: those that decode, and which ones did not ("run R rank N"), left
    out so that a damaged row makes a deadline less sharp but never stops a startup or a
    report."""

    rows: list[RankDurations]
    skipped: tuple[str, ...] = ()

    def warning(self, location: str) -> str | None:
        """One line for the rows left out, or None."""
        if not self.skipped:
            return None
        shown = ", ".join(self.skipped[:3]) + (", ..." if len(self.skipped) > 3 else "")
        return (
            f"{location}: {len(self.skipped)} startup history row(s) that do not decode"
            f" left out ({shown})"
        )


def _read(conn: Connection, stmt: Any) -> HistoryRead:
    rows, skipped = [], []
    for row in conn.execute(stmt):
        found = decoded(row)
        if found is None:
            skipped.append(f"run {str(row[0])[:64]} rank {row[1]}")
        else:
            rows.append(found)
    return HistoryRead(rows, tuple(skipped))


def recent_history(conn: Connection, key: str, *, ranks: int) -> HistoryRead:
    """The rows of the newest SAMPLE_RUNS runs of `key` with `ranks` ranks each, newest first,
    through the index on (key, ready_wall)."""
    c = startup_history.c
    stmt = (
        select(c.run_id, c.rank, c.key, c.ready_wall, c.process_ready_s, c.durations)
        .where(c.key == key)
        .order_by(c.ready_wall.desc())
        .limit(SAMPLE_RUNS * max(1, ranks))
    )
    return _read(conn, stmt)


def all_history(conn: Connection) -> HistoryRead:
    """Every row of the history, oldest first."""
    c = startup_history.c
    stmt = select(c.run_id, c.rank, c.key, c.ready_wall, c.process_ready_s, c.durations).order_by(
        c.ready_wall, c.run_id, c.rank
    )
    return _read(conn, stmt)


def has_history(revision: str) -> bool:
    """Whether a journal at `revision` keeps the startup history."""
    return KNOWN_REVISIONS.index(revision) >= KNOWN_REVISIONS.index(HISTORY_REVISION)


def history_of(engine: Engine, location: str, revision: str) -> HistoryRead:
    """Every row of the history of the journal behind `engine` at `revision`, oldest first;
    none in a journal older than HISTORY_REVISION."""
    if not has_history(revision):
        return HistoryRead([])
    try:
        with engine.connect() as conn:
            return all_history(conn)
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, location, opened=True) from None


def decoded(row: Any) -> RankDurations | None:
    """A history row as a record; None for a row that is not one this lifecycle writes (a
    damaged or hand-written one is left out rather than guessed at)."""
    run_id, rank, key, ready_wall, process_ready_s, durations = row
    if isinstance(durations, str) and len(durations) > MAX_DURATIONS_CHARS:
        return None
    if not (isinstance(run_id, str) and is_int(rank) and isinstance(key, str)):
        return None
    if not (is_number(ready_wall) and math.isfinite(ready_wall)):
        return None
    if not (process_ready_s is None or is_number(process_ready_s)):
        return None
    spent = json_column(durations) if isinstance(durations, str) else None
    if not isinstance(spent, dict) or not all(
        isinstance(s, str) and is_number(v) and math.isfinite(v) and v >= 0
        for s, v in spent.items()
    ):
        return None
    return RankDurations(
        run_id=run_id,
        rank=rank,
        key=key,
        ready_wall=float(ready_wall),
        process_ready_s=None if process_ready_s is None else float(process_ready_s),
        durations=tuple((state, float(seconds)) for state, seconds in spent.items()),
    )


def probes_of(
    engine: Engine, location: str, run_ids: Sequence[str]
) -> tuple[list[StoredEvent], list[str]]:
    """Each rank's `rank_probed` event of the given runs, in (run_id, rank, seq) order, and
    what is wrong with the rows that do not decode (left out)."""
    found: list[StoredEvent] = []
    problems: list[str] = []
    try:
        with engine.connect() as conn:
            for start in range(0, len(run_ids), PROBE_RUNS_PER_QUERY):
                chunk = list(run_ids[start : start + PROBE_RUNS_PER_QUERY])
                stmt = EVENT_ROW.where(
                    events.c.run_id.in_(chunk), events.c.kind == RankProbed.kind
                ).order_by(events.c.run_id, events.c.rank, events.c.seq)
                for row in conn.execute(stmt):
                    stored, wrong = decode_row(row, location)
                    problems.extend(wrong)
                    if stored is not None and isinstance(stored.event, RankProbed):
                        found.append(stored)
    except DATABASE_ERRORS as exc:
        raise journal_error(exc, location, opened=True) from None
    return found, problems
