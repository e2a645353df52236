"""Hand-built journals, written through the real journal API, for cases no fault produces:
how a test of `replay` or of a verdict builds the run it reads."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifecycle.core.format.events import (
    CollectiveFinished,
    CollectiveStarted,
    Error,
    Event,
    Heartbeat,
    Transition,
)
from lifecycle.core.format.records import PendingCollective
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.store import Journal, RankWriter, RunRow

T0 = 1_800_000_000.0  # a hand-built run's start (2027-01-15), the wall clock its events count from
# Hand-built journals are judged as read while they were written: `--now` at their start
# makes the reader's clock no later than their last event, whatever today's date.
AS_WRITTEN = ("--now", str(T0))


@dataclass
class RankStream:
    """One rank's stream of events, appended at seconds after `T0`, tracking its state."""

    writer: RankWriter
    state: str = "created"

    def add(self, at: float, event: Event, *, state: str | None = None) -> None:
        """Append `event` at `at` seconds, in `state` (the rank's current state unless given)."""
        if isinstance(event, Transition):
            self.state = event.dest
        self.writer.append(
            event, state=state or self.state, wall_time=T0 + at, mono_ns=int(at * 1e9)
        )

    def walk(self, at: float, *states: str) -> None:
        """Transitions through `states` in order, 0.1 s apart from `at`."""
        source = self.state
        for i, dest in enumerate(states):
            self.add(at + i * 0.1, Transition(trigger="t", source=source, dest=dest))
            source = dest


@dataclass
class JournalBuilder:
    """A new SQLite journal at `path` holding one run, whose ranks' streams a test writes."""

    path: Path
    run_id: str = "run-hand-built"
    world_size: int = 2
    config: dict[str, Any] = field(default_factory=lambda: args_to_json(ServerArgs()))
    ranks: dict[int, RankStream] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.journal = Journal.open_for_write(str(self.path))
        self.journal.create_run(
            RunRow(
                run_id=self.run_id,
                created_at=T0,
                host="builder",
                world_size=self.world_size,
                config=self.config,
                lifecycle_version="0.1.0",
            )
        )

    def rank(self, rank: int) -> RankStream:
        """The stream of `rank`, its writer opened on first use."""
        if rank not in self.ranks:
            self.ranks[rank] = RankStream(self.journal.writer(run_id=self.run_id, rank=rank))
        return self.ranks[rank]

    def close(self) -> None:
        """Close every rank's writer and the journal."""
        for stream in self.ranks.values():
            stream.writer.close()
        self.journal.close()


def a2a(
    group: str,
    seq: int,
    *,
    ranks: tuple[int, ...] = (0, 1),
    shape: tuple[int, ...] = (2, 8),
    splits: tuple[int, ...] = (8, 8),
    out_splits: tuple[int, ...] | None = None,
    op: str = "all_to_all",
    purpose: str = "ulysses-qkv",
) -> CollectiveStarted:
    """The start of collective `seq` of `group` (an all-to-all of Ulysses attention unless
    told otherwise)."""
    return CollectiveStarted(
        group=group, group_ranks=ranks, group_seq=seq, op=op, purpose=purpose,
        dtype="float32", shapes=(shape, shape), input_splits=splits,
        output_splits=out_splits if out_splits is not None else splits, timeout_s=600.0,
    )  # fmt: skip


def done(group: str, seq: int, op: str = "all_to_all") -> CollectiveFinished:
    """The finish of collective `seq` of `group`."""
    return CollectiveFinished(group=group, group_seq=seq, op=op, duration_s=0.01)


def beat(pending: CollectiveStarted | None = None) -> Heartbeat:
    """A heartbeat, waiting in `pending` when one is given."""
    return Heartbeat(
        uptime_s=1.0,
        in_state_s=1.0,
        pending=None
        if pending is None
        else PendingCollective(
            group=pending.group,
            group_seq=pending.group_seq,
            op=pending.op,
            purpose=pending.purpose,
            waiting_s=1.0,
        ),
    )


def timeout_error(
    group: str, seq: int, *, error_type: str = "CollectiveTimeout", kind: str = "collective-timeout"
) -> Error:
    """The fatal error of a rank whose collective `seq` of `group` timed out."""
    return Error(
        error_type=error_type,
        error_kind=kind,
        message=f"all_to_all #{seq} in group {group} did not finish within 600 s",
        traceback="",
        trigger=None,
        fatal=True,
    )


def append_raw(
    db: Path, *, rank: int, at: float, kind: str, version: int, state: str, data: str
) -> None:
    """One row appended to a rank's stream as an older lifecycle wrote it, bypassing the codec."""
    with sqlite3.connect(db) as conn:
        (seq,) = conn.execute(
            "SELECT coalesce(max(seq), -1) + 1 FROM events WHERE rank = ?", (rank,)
        ).fetchone()
        conn.execute(
            "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state,"
            " data) VALUES ('run-hand-built', ?, ?, ?, ?, ?, ?, ?, ?)",
            (rank, seq, T0 + at, int(at * 1e9), kind, version, state, data),
        )
