"""Rebuild each rank's state and records by folding its events (pure; shared with replay)."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from lifecycle.core.format import events as ev
from lifecycle.core.format.groupfold import GroupTally, merge_marks, pending_collective
from lifecycle.core.format.records import PendingCollective, Signature
from lifecycle.core.format.states import State
from lifecycle.core.format.view import (
    ActionTime,
    OpenCollective,
    RankView,
    RecentStart,
    RequestLag,
    SeqGap,
    Span,
)

# How many of each group's latest collectives a rank's fold keeps with their signature and start
# time: what diagnosis compares across members (a mismatch) and times (who came late) at the
# end of a run. A fold's size, and a summary's, does not grow with the run.
RECENT_STARTS = 16
# The actions a fold keeps before ready (a few per state: a bound against a journal that says
# otherwise, not a limit a startup meets).
MAX_ACTIONS = 256
# Beyond this a measured clock offset is no offset (a clock not set at all): left as recorded.
MAX_CLOCK_OFFSET_S = 1e8
# Each rank's lag entering collectives, for this many of its latest requests (a straggler is
# named from their median).
RECENT_LAGS = 50
# Each rank's last few heartbeats: a rank that wrote nothing while a peer wrote several was dead.
RECENT_HEARTBEATS = 4


# The events a fold keeps with when, and in which state, each was written: each kind by the
# name of the RankFold list that keeps it, in the order a checkpoint writes them.
NOTED_LISTS: tuple[tuple[type[ev.Event], str], ...] = (
    (ev.Error, "errors"),
    (ev.FaultInjected, "faults"),
    (ev.Stalled, "stalls"),
    (ev.BuffersAllocated, "buffer_allocations"),
    (ev.BuffersDropped, "buffer_drops"),
    (ev.CollectivesDumped, "dumps"),
    (ev.ResidencyEvent, "residency"),
    (ev.FlightRecorderDumped, "flight_dumps"),
    (ev.Aborted, "aborts"),
    (ev.LoadEvent, "loads"),
    (ev.CompileEvent, "compiles"),
    (ev.RankCheckEvent, "rank_checks"),
)


_NOTED_BY_KIND: dict[type[ev.Event], str | None] = {}


def noted_list(kind: type[ev.Event]) -> str | None:
    """The RankFold list that keeps events of `kind`, if a fold keeps them."""
    try:
        return _NOTED_BY_KIND[kind]
    except KeyError:
        found = next((name for noted, name in NOTED_LISTS if issubclass(kind, noted)), None)
        _NOTED_BY_KIND[kind] = found
        return found


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
    run_started: ev.RunStarted | None = None
    expectations: ev.Expectations | None = None
    path: list[str] = field(default_factory=lambda: [State.CREATED.value])
    spans: list[Span] = field(default_factory=list)
    gate: ev.GateDecided | None = None
    plan: ev.PlanBuilt | None = None
    warmup_records: list[ev.WarmupRecord] = field(default_factory=list)
    action: ev.ActionStarted | None = None
    action_at: float | None = None
    ready_action_done: bool = False
    errors: list[tuple[float, str, ev.Error]] = field(default_factory=list)
    faults: list[tuple[float, str, ev.FaultInjected]] = field(default_factory=list)
    stalls: list[tuple[float, str, ev.Stalled]] = field(default_factory=list)
    live_buffer_bytes: int = 0
    buffer_allocations: list[tuple[float, str, ev.BuffersAllocated]] = field(default_factory=list)
    buffer_drops: list[tuple[float, str, ev.BuffersDropped]] = field(default_factory=list)
    groups: dict[str, GroupTally] = field(default_factory=dict)
    open_collectives: dict[str, OpenCollective] = field(default_factory=dict)
    heartbeats: int = 0
    last_heartbeat_wall: float | None = None
    last_heartbeat_pending: PendingCollective | None = None
    requests_started: int = 0
    requests_finished: int = 0
    shutdown: ev.Shutdown | None = None
    unknown: list[ev.UnknownEvent] = field(default_factory=list)
    seq_gaps: list[SeqGap] = field(default_factory=list)
    dumps: list[tuple[float, str, ev.CollectivesDumped]] = field(default_factory=list)
    residency: list[tuple[float, str, ev.ResidencyEvent]] = field(default_factory=list)
    flight_dumps: list[tuple[float, str, ev.FlightRecorderDumped]] = field(default_factory=list)
    aborts: list[tuple[float, str, ev.Aborted]] = field(default_factory=list)
    loads: list[tuple[float, str, ev.LoadEvent]] = field(default_factory=list)
    compiles: list[tuple[float, str, ev.CompileEvent]] = field(default_factory=list)
    rank_checks: list[tuple[float, str, ev.RankCheckEvent]] = field(default_factory=list)
    lags: list[RequestLag] = field(default_factory=list)
    actions_done: list[ActionTime] = field(default_factory=list)
    recent_starts: dict[str, deque[RecentStart]] = field(default_factory=dict)
    recent_heartbeats: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_HEARTBEATS))
    last_progress: float | None = None
    shutdown_wall: float | None = None
    clock: ev.ClockAligned | None = None

    def apply(self, stored: ev.StoredEvent) -> None:
        """Fold one event: its envelope, what its kind changes, then the state it was written in."""
        at = stored.wall_time
        self._envelope(stored)
        event = stored.event
        # The kinds a journal holds most of first: each case is an isinstance test.
        match event:
            case ev.CollectiveStarted():
                self._start_collective(event, at)
            case ev.CollectiveFinished():
                self._finish_collective(event)
            case ev.Heartbeat():
                self._beat(event, at)
            case ev.Transition():
                self._enter(event.dest, at)
            case ev.RunStarted():
                self.run_started = event
            case ev.Expectations():
                self.expectations = event
            case ev.GateDecided():
                self.gate = event
            case ev.PlanBuilt():
                self.plan = event
            case ev.ActionStarted():
                self.action, self.action_at = event, at
            case ev.ActionFinished():
                self._finish_action(event, stored.state, at)
            case ev.WarmupRecord():
                self.warmup_records.append(event)
            case ev.BuffersAllocated():
                self.live_buffer_bytes = event.live_bytes
            case ev.BuffersDropped():
                self.live_buffer_bytes = 0
            case ev.RequestStarted():
                self.requests_started += 1
            case ev.RequestFinished():
                self.requests_finished += 1
                merge_marks(self.groups, event.groups)
                if event.lag_s is not None:
                    self.lags.append(RequestLag(at=at, lag_s=event.lag_s, group=event.lag_group))
                    del self.lags[:-RECENT_LAGS]
            case ev.ClockAligned():
                self.clock = event
                self._onto_rank0_clock(event.offset_s, before=at)
            case ev.Shutdown():
                self.shutdown = event
            case ev.UnknownEvent():
                self.unknown.append(event)
            case _:
                pass
        noted = noted_list(type(event))
        if noted is not None:
            getattr(self, noted).append((at, stored.state, event))
        # The envelope's state is authoritative: it is what the rank had committed to. Not for
        # collective records, which a dump of the ring writes after the state they ran in.
        if (
            stored.state != self.state
            and stored.state in _STATES
            and not isinstance(event, ev.CollectiveStarted | ev.CollectiveFinished)
        ):
            self._enter(stored.state, at)

    def _envelope(self, stored: ev.StoredEvent) -> None:
        """What every event says, whatever its kind: its seq, its time, and whether it is
        progress."""
        at = stored.wall_time
        if stored.seq != self.last_seq + 1:
            self.seq_gaps.append(SeqGap(expected=self.last_seq + 1, found=stored.seq))
        self.last_seq = stored.seq
        self.events += 1
        if self.first_wall is None:
            self.first_wall = at
            self.spans.append(Span(state=State.CREATED.value, entered_at=at, left_at=None))
        # Collective records dumped from the ring after ready come after later events.
        self.last_wall = at if self.last_wall is None else max(self.last_wall, at)
        self.last_kind = stored.kind
        event = stored.event
        if isinstance(event, ev.Shutdown):
            # Being told to stop is not progress: a rank stopped while stuck stays stuck.
            if self.shutdown_wall is None:
                self.shutdown_wall = at
        elif not isinstance(event, ev.Heartbeat):
            self.last_progress = at if self.last_progress is None else max(self.last_progress, at)

    def _start_collective(self, event: ev.CollectiveStarted, at: float) -> None:
        """A collective entered: its group's count, its open record, its recent starts."""
        group = self.groups.setdefault(event.group, GroupTally(ranks=event.group_ranks))
        group.started = max(group.started, event.group_seq)
        group.count += 1
        self.open_collectives[event.group] = OpenCollective(started=event, at=at)
        recent = self.recent_starts.get(event.group)
        if recent is None:
            recent = self.recent_starts[event.group] = deque(maxlen=RECENT_STARTS)
        recent.append(RecentStart(seq=event.group_seq, at=at, signature=Signature.of(event)))

    def _finish_collective(self, event: ev.CollectiveFinished) -> None:
        """A collective left: its group's progress, and its record closed if still open."""
        group = self.groups.setdefault(event.group, GroupTally(ranks=()))
        group.finished = max(group.finished, event.group_seq)
        opened = self.open_collectives.get(event.group)
        if opened is not None and opened.started.group_seq == event.group_seq:
            del self.open_collectives[event.group]

    def _beat(self, event: ev.Heartbeat, at: float) -> None:
        """A heartbeat: when it came, what it waited in, and its groups' progress."""
        self.heartbeats += 1
        self.last_heartbeat_wall = at
        self.last_heartbeat_pending = event.pending
        self.recent_heartbeats.append(at)
        merge_marks(self.groups, event.groups)

    def _finish_action(self, event: ev.ActionFinished, state: str, at: float) -> None:
        """An action done: timed while the startup lasts, and the rank idle again."""
        if not self.ready_action_done and len(self.actions_done) < MAX_ACTIONS:
            self.actions_done.append(
                ActionTime(
                    state=state,
                    action=event.action,
                    started_at=at - event.duration_s,
                    seconds=event.duration_s,
                    ok=event.ok,
                )
            )
        self.action = self.action_at = None
        if state == State.READY and event.ok:
            self.ready_action_done = True

    def _onto_rank0_clock(self, offset_s: float, *, before: float) -> None:
        """The few events before the rank's clock was aligned (its start, the rendezvous, the
        heartbeats while it waited) carry its own clock: put them on rank 0's too."""
        if not offset_s or abs(offset_s) > MAX_CLOCK_OFFSET_S:
            return  # none, or not an offset between two clocks that tell today's date

        def moved(wall: float | None) -> float | None:
            return None if wall is None else wall - offset_s

        self.first_wall = moved(self.first_wall)
        self.action_at = moved(self.action_at)
        self.last_heartbeat_wall = moved(self.last_heartbeat_wall)
        self.last_progress = before if self.last_progress is not None else None
        self.recent_heartbeats = deque(
            (w - offset_s for w in self.recent_heartbeats), maxlen=RECENT_HEARTBEATS
        )
        self.actions_done = [
            dataclasses.replace(done, started_at=done.started_at - offset_s)
            for done in self.actions_done
        ]
        self.loads = [(at - offset_s, state, event) for at, state, event in self.loads]
        self.compiles = [(at - offset_s, state, event) for at, state, event in self.compiles]
        self.spans = [
            Span(
                state=span.state,
                entered_at=span.entered_at - offset_s,
                left_at=moved(span.left_at),
            )
            for span in self.spans
        ]
        self.last_wall = before

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
        as_is = {name: frozen(getattr(self, name)) for name in _VIEW_AS_IS}
        return RankView(
            **as_is,
            skip_reason=self.plan.skip_reason if self.plan else self.gate_skip_reason,
            groups=tuple(g.mark(name) for name, g in sorted(self.groups.items())),
            pending=pending_collective(
                self.open_collectives,
                self.groups,
                self.last_heartbeat_pending,
                self.last_heartbeat_wall,
            ),
            recent_starts=tuple(
                (name, tuple(starts)) for name, starts in sorted(self.recent_starts.items())
            ),
        )

    @property
    def gate_skip_reason(self) -> str | None:
        return self.gate.skip_reason if self.gate else None


_STATES = frozenset(s.value for s in State)

# RankView's fields that are RankFold's own, frozen (lists as tuples); the others are derived.
_VIEW_AS_IS = tuple(
    f.name
    for f in fields(RankView)
    if f.name not in ("skip_reason", "groups", "pending", "recent_starts")
)


def frozen(value: Any) -> Any:
    """A fold's list or deque as a tuple, for a view or a checkpoint; anything else as it is."""
    return tuple(value) if isinstance(value, list | deque) else value


def fold_rank(events: Iterable[ev.StoredEvent], *, run_id: str = "", rank: int = 0) -> RankView:
    """Fold one rank's events (in seq order) into its view."""
    acc: RankFold | None = None
    for stored in events:
        if acc is None:
            acc = RankFold(run_id=stored.run_id, rank=stored.rank)
        acc.apply(stored)
    return (acc or RankFold(run_id=run_id, rank=rank)).view()


def fold_run(
    events: Iterable[ev.StoredEvent], *, until: float | None = None
) -> dict[int, RankView]:
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
