"""Rebuild each rank's state and records by folding its events (pure; shared with replay)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lifecycle.core.events import (
    ActionFinished,
    ActionStarted,
    BuffersAllocated,
    BuffersDropped,
    CollectiveFinished,
    CollectiveStarted,
    Error,
    FaultInjected,
    GateDecided,
    Heartbeat,
    PendingCollective,
    PlanBuilt,
    RequestFinished,
    RequestStarted,
    RunStarted,
    Shutdown,
    Stalled,
    StoredEvent,
    Transition,
    UnknownEvent,
    WarmupRecord,
)
from lifecycle.core.states import State


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    """A stretch of time a rank spent in one state; `left_at` is None while it is still there."""

    state: str
    entered_at: float
    left_at: float | None

    def duration_s(self, *, now: float | None = None) -> float | None:
        end = self.left_at if self.left_at is not None else now
        return None if end is None else max(0.0, end - self.entered_at)


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenCollective:
    """A collective this rank started and has not finished."""

    started: CollectiveStarted
    at: float  # wall time of the started event


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupProgress:
    group: str
    ranks: tuple[int, ...]
    started: int  # highest group sequence number started, -1 before the first
    finished: int  # highest group sequence number finished, -1 before the first
    count: int  # collectives started in this group


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqGap:
    expected: int
    found: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankView:
    """Everything known of one rank after its events, and nothing that did not come from them."""

    run_id: str
    rank: int
    state: str
    events: int
    last_seq: int
    first_wall: float | None
    last_wall: float | None
    last_kind: str | None
    run_started: RunStarted | None
    path: tuple[str, ...]  # states entered, in order, starting at created
    spans: tuple[Span, ...]
    gate: GateDecided | None
    plan: PlanBuilt | None
    skip_reason: str | None
    warmup_records: tuple[WarmupRecord, ...]
    action: ActionStarted | None  # the action running now (started, not finished)
    action_at: float | None
    ready_action_done: bool
    errors: tuple[tuple[float, str, Error], ...]  # (wall time, state, error)
    faults: tuple[tuple[float, str, FaultInjected], ...]
    stalls: tuple[tuple[float, str, Stalled], ...]
    live_buffer_bytes: int
    buffer_allocations: tuple[tuple[float, str, BuffersAllocated], ...]
    buffer_drops: tuple[tuple[float, str, BuffersDropped], ...]
    groups: tuple[GroupProgress, ...]
    pending: OpenCollective | None
    heartbeats: int
    last_heartbeat_wall: float | None
    last_heartbeat_pending: PendingCollective | None
    requests_started: int
    requests_finished: int
    shutdown: Shutdown | None
    unknown: tuple[UnknownEvent, ...]
    seq_gaps: tuple[SeqGap, ...]

    @property
    def terminal(self) -> bool:
        return self.state in (State.FAILED, State.STOPPED)

    @property
    def healthy(self) -> bool:
        """Ready, and the ready action (with its smoke request, if any) has finished."""
        return self.state == State.READY and self.ready_action_done

    @property
    def calibrated(self) -> bool:
        return State.PROBE in self.path

    def entered_at(self, state: str) -> float | None:
        return next((s.entered_at for s in self.spans if s.state == state), None)

    def time_in_state_s(self, *, now: float) -> float | None:
        return self.spans[-1].duration_s(now=now) if self.spans else None


@dataclass(slots=True)
class _Group:
    ranks: tuple[int, ...]
    started: int = -1
    finished: int = -1
    count: int = 0


@dataclass(slots=True)
class RankFold:
    """The accumulator behind fold_rank; `apply` one event at a time, then take `view()`."""

    run_id: str
    rank: int
    state: str = State.CREATED.value
    events: int = 0
    last_seq: int = -1
    first_wall: float | None = None
    last_wall: float | None = None
    last_kind: str | None = None
    run_started: RunStarted | None = None
    path: list[str] = field(default_factory=lambda: [State.CREATED.value])
    spans: list[Span] = field(default_factory=list)
    gate: GateDecided | None = None
    plan: PlanBuilt | None = None
    warmup_records: list[WarmupRecord] = field(default_factory=list)
    action: ActionStarted | None = None
    action_at: float | None = None
    ready_action_done: bool = False
    errors: list[tuple[float, str, Error]] = field(default_factory=list)
    faults: list[tuple[float, str, FaultInjected]] = field(default_factory=list)
    stalls: list[tuple[float, str, Stalled]] = field(default_factory=list)
    live_buffer_bytes: int = 0
    buffer_allocations: list[tuple[float, str, BuffersAllocated]] = field(default_factory=list)
    buffer_drops: list[tuple[float, str, BuffersDropped]] = field(default_factory=list)
    groups: dict[str, _Group] = field(default_factory=dict)
    open_collectives: dict[str, OpenCollective] = field(default_factory=dict)
    heartbeats: int = 0
    last_heartbeat_wall: float | None = None
    last_heartbeat_pending: PendingCollective | None = None
    requests_started: int = 0
    requests_finished: int = 0
    shutdown: Shutdown | None = None
    unknown: list[UnknownEvent] = field(default_factory=list)
    seq_gaps: list[SeqGap] = field(default_factory=list)

    def apply(self, stored: StoredEvent) -> None:
        at = stored.wall_time
        if stored.seq != self.last_seq + 1:
            self.seq_gaps.append(SeqGap(expected=self.last_seq + 1, found=stored.seq))
        self.last_seq = stored.seq
        self.events += 1
        if self.first_wall is None:
            self.first_wall = at
            self.spans.append(Span(state=State.CREATED.value, entered_at=at, left_at=None))
        self.last_wall = at
        self.last_kind = stored.kind
        event = stored.event
        match event:
            case Transition():
                self._enter(event.dest, at)
            case RunStarted():
                self.run_started = event
            case GateDecided():
                self.gate = event
            case PlanBuilt():
                self.plan = event
            case ActionStarted():
                self.action, self.action_at = event, at
            case ActionFinished():
                self.action = self.action_at = None
                if stored.state == State.READY and event.ok:
                    self.ready_action_done = True
            case WarmupRecord():
                self.warmup_records.append(event)
            case CollectiveStarted():
                group = self.groups.setdefault(event.group, _Group(ranks=event.group_ranks))
                group.started = max(group.started, event.group_seq)
                group.count += 1
                self.open_collectives[event.group] = OpenCollective(started=event, at=at)
            case CollectiveFinished():
                group = self.groups.setdefault(event.group, _Group(ranks=()))
                group.finished = max(group.finished, event.group_seq)
                opened = self.open_collectives.get(event.group)
                if opened is not None and opened.started.group_seq == event.group_seq:
                    del self.open_collectives[event.group]
            case BuffersAllocated():
                self.live_buffer_bytes = event.live_bytes
                self.buffer_allocations.append((at, stored.state, event))
            case BuffersDropped():
                self.live_buffer_bytes = 0
                self.buffer_drops.append((at, stored.state, event))
            case Heartbeat():
                self.heartbeats += 1
                self.last_heartbeat_wall = at
                self.last_heartbeat_pending = event.pending
            case Stalled():
                self.stalls.append((at, stored.state, event))
            case Error():
                self.errors.append((at, stored.state, event))
            case FaultInjected():
                self.faults.append((at, stored.state, event))
            case RequestStarted():
                self.requests_started += 1
            case RequestFinished():
                self.requests_finished += 1
            case Shutdown():
                self.shutdown = event
            case UnknownEvent():
                self.unknown.append(event)
            case _:
                pass
        # The envelope's state is authoritative: it is what the rank had committed to.
        if stored.state != self.state and stored.state in _STATES:
            self._enter(stored.state, at)

    def _enter(self, state: str, at: float) -> None:
        if state == self.state and self.path[-1] == state:
            return
        if self.spans:
            last = self.spans[-1]
            self.spans[-1] = Span(state=last.state, entered_at=last.entered_at, left_at=at)
        self.spans.append(Span(state=state, entered_at=at, left_at=None))
        self.path.append(state)
        self.state = state

    def view(self) -> RankView:
        pending = (
            max(self.open_collectives.values(), key=lambda o: o.at)
            if self.open_collectives
            else None
        )
        return RankView(
            run_id=self.run_id,
            rank=self.rank,
            state=self.state,
            events=self.events,
            last_seq=self.last_seq,
            first_wall=self.first_wall,
            last_wall=self.last_wall,
            last_kind=self.last_kind,
            run_started=self.run_started,
            path=tuple(self.path),
            spans=tuple(self.spans),
            gate=self.gate,
            plan=self.plan,
            skip_reason=self.plan.skip_reason if self.plan else self.gate_skip_reason,
            warmup_records=tuple(self.warmup_records),
            action=self.action,
            action_at=self.action_at,
            ready_action_done=self.ready_action_done,
            errors=tuple(self.errors),
            faults=tuple(self.faults),
            stalls=tuple(self.stalls),
            live_buffer_bytes=self.live_buffer_bytes,
            buffer_allocations=tuple(self.buffer_allocations),
            buffer_drops=tuple(self.buffer_drops),
            groups=tuple(
                GroupProgress(
                    group=name, ranks=g.ranks, started=g.started, finished=g.finished, count=g.count
                )
                for name, g in sorted(self.groups.items())
            ),
            pending=pending,
            heartbeats=self.heartbeats,
            last_heartbeat_wall=self.last_heartbeat_wall,
            last_heartbeat_pending=self.last_heartbeat_pending,
            requests_started=self.requests_started,
            requests_finished=self.requests_finished,
            shutdown=self.shutdown,
            unknown=tuple(self.unknown),
            seq_gaps=tuple(self.seq_gaps),
        )

    @property
    def gate_skip_reason(self) -> str | None:
        return self.gate.skip_reason if self.gate else None


_STATES = frozenset(s.value for s in State)


def fold_rank(events: Iterable[StoredEvent], *, run_id: str = "", rank: int = 0) -> RankView:
    """Fold one rank's events (in seq order) into its view."""
    acc: RankFold | None = None
    for stored in events:
        if acc is None:
            acc = RankFold(run_id=stored.run_id, rank=stored.rank)
        acc.apply(stored)
    return (acc or RankFold(run_id=run_id, rank=rank)).view()


def fold_run(events: Iterable[StoredEvent], *, until: float | None = None) -> dict[int, RankView]:
    """Fold a run's events, any rank order, into one view per rank.

    `until` keeps only the events written at or before that wall time: the state of every rank
    at that moment.
    """
    folds: dict[int, RankFold] = {}
    for stored in events:
        if until is not None and stored.wall_time > until:
            continue
        acc = folds.get(stored.rank)
        if acc is None:
            acc = folds[stored.rank] = RankFold(run_id=stored.run_id, rank=stored.rank)
        acc.apply(stored)
    return {rank: acc.view() for rank, acc in sorted(folds.items())}
