"""A rank's fold as a checkpoint: the summary its writer keeps, and a reader restores (pure).

A reader restores the fold from the checkpoint and applies only the events after it, so
`diagnose` and `runs` cost what the summaries hold, not what the journal holds. The format is
FOLD_VERSION: a reader that meets another version folds that rank from its first event
instead, so changing RankFold, or the version of an event kind it keeps, means a new version.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass
from typing import Any

from lifecycle.core.codec import decode_payload, dumps_record, loads_record, to_payload
from lifecycle.core.events import (
    ActionStarted,
    BuffersAllocated,
    BuffersDropped,
    ClockAligned,
    CollectivesDumped,
    Error,
    Event,
    FaultInjected,
    FlightRecorderDumped,
    GateDecided,
    PlanBuilt,
    ResidencyEvent,
    RunStarted,
    Shutdown,
    Stalled,
    UnknownEvent,
    WarmupRecord,
)
from lifecycle.core.fold import RECENT_HEARTBEATS, RECENT_STARTS, GroupTally, RankFold
from lifecycle.core.records import GroupMark, PendingCollective
from lifecycle.core.view import OpenCollective, RecentStart, SeqGap, Span

FOLD_VERSION = 3  # 2: the residency planner's events are noted; 3: Flight Recorder dumps


@dataclass(frozen=True, slots=True, kw_only=True)
class NotedEvent:
    """An event a fold keeps with when, and in which state, it was written."""

    at: float
    state: str
    kind: str
    version: int
    data: Any  # the payload, a JSON object as the journal holds it

    @classmethod
    def of(cls, at: float, state: str, event: Event) -> NotedEvent:
        return cls(
            at=at, state=state, kind=event.kind, version=event.version, data=to_payload(event)
        )

    def restore(self) -> tuple[float, str, Event]:
        return self.at, self.state, decode_payload(self.kind, self.version, self.data)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStarts:
    group: str
    starts: tuple[RecentStart, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class FoldCheckpoint:
    """RankFold's fields, in types the journal's codec reads back."""

    run_id: str
    rank: int
    state: str
    events: int
    last_seq: int
    first_wall: float | None
    last_wall: float | None
    last_kind: str | None
    run_started: RunStarted | None
    path: tuple[str, ...]
    spans: tuple[Span, ...]
    gate: GateDecided | None
    plan: PlanBuilt | None
    warmup_records: tuple[WarmupRecord, ...]
    action: ActionStarted | None
    action_at: float | None
    ready_action_done: bool
    noted: tuple[NotedEvent, ...]  # errors, faults, stalls, buffer records, dumps, in order
    live_buffer_bytes: int
    groups: tuple[GroupMark, ...]
    open_collectives: tuple[OpenCollective, ...]
    heartbeats: int
    last_heartbeat_wall: float | None
    last_heartbeat_pending: PendingCollective | None
    requests_started: int
    requests_finished: int
    shutdown: Shutdown | None
    unknown: tuple[UnknownEvent, ...]
    seq_gaps: tuple[SeqGap, ...]
    recent_starts: tuple[GroupStarts, ...]
    recent_heartbeats: tuple[float, ...]
    last_progress: float | None
    shutdown_wall: float | None
    clock: ClockAligned | None


# The noted events, each kind by the name of the RankFold list that keeps it, in the order a
# checkpoint writes them.
_NOTED_LISTS: tuple[tuple[type[Event], str], ...] = (
    (Error, "errors"),
    (FaultInjected, "faults"),
    (Stalled, "stalls"),
    (BuffersAllocated, "buffer_allocations"),
    (BuffersDropped, "buffer_drops"),
    (CollectivesDumped, "dumps"),
    (ResidencyEvent, "residency"),
    (FlightRecorderDumped, "flight_dumps"),
)


def _noted(fold: RankFold) -> tuple[NotedEvent, ...]:
    return tuple(
        NotedEvent.of(at, state, event)
        for _, name in _NOTED_LISTS
        for at, state, event in getattr(fold, name)
    )


# RankFold's fields a checkpoint holds as they are (lists as tuples); the others are the noted
# events, the groups, the open collectives and the recent starts, converted below.
_AS_IS = tuple(
    f.name
    for f in dataclasses.fields(FoldCheckpoint)
    if f.name not in ("noted", "groups", "open_collectives", "recent_starts")
)
_LISTS = frozenset({"path", "spans", "warmup_records", "unknown", "seq_gaps"})


def checkpoint(fold: RankFold) -> str:
    """The fold as JSON text."""
    plain = {name: getattr(fold, name) for name in _AS_IS}
    plain = {k: tuple(v) if isinstance(v, list | deque) else v for k, v in plain.items()}
    return dumps_record(
        FoldCheckpoint(
            **plain,
            noted=_noted(fold),
            groups=tuple(g.mark(name) for name, g in fold.groups.items()),
            open_collectives=tuple(fold.open_collectives.values()),
            recent_starts=tuple(
                GroupStarts(group=name, starts=tuple(starts))
                for name, starts in fold.recent_starts.items()
            ),
        )
    )


def restore(text: str) -> RankFold:
    """The fold a checkpoint holds; CorruptEvent when it does not read."""
    c = loads_record(FoldCheckpoint, text)
    fold = RankFold(run_id=c.run_id, rank=c.rank)
    for name in _AS_IS:
        value = getattr(c, name)
        setattr(fold, name, list(value) if name in _LISTS else value)
    fold.recent_heartbeats = deque(c.recent_heartbeats, maxlen=RECENT_HEARTBEATS)
    for at, state, event in (noted.restore() for noted in c.noted):
        for kind, name in _NOTED_LISTS:
            if isinstance(event, kind):
                getattr(fold, name).append((at, state, event))
                break
    fold.groups = {g.group: GroupTally.of(g) for g in c.groups}
    fold.open_collectives = {o.started.group: o for o in c.open_collectives}
    fold.recent_starts = {g.group: deque(g.starts, maxlen=RECENT_STARTS) for g in c.recent_starts}
    return fold
