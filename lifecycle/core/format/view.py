"""What a fold knows of one rank: its view and the records in it (pure; shared with replay)."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.format import events as ev
from lifecycle.core.format.records import GroupMark, PendingCollective, Signature
from lifecycle.core.format.states import State


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
class ActionTime:
    """An action a rank finished: in which state, when it began and how long it took (as the
    rank measured it)."""

    state: str
    action: str
    started_at: float
    seconds: float
    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class OpenCollective:
    """A collective this rank started and has not finished.

    `from_heartbeat`: its record never reached the journal (after ready it waited in the
    rank's ring, and the rank died before a dump); it is known from the rank's last heartbeat,
    which is at most one interval old, and `started` holds only what a heartbeat says.
    """

    started: ev.CollectiveStarted
    at: float  # wall time of the started event
    from_heartbeat: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RecentStart:
    """One of a rank's latest collectives in a group: when it started, and what it was."""

    seq: int
    at: float
    signature: Signature


@dataclass(frozen=True, slots=True, kw_only=True)
class SeqGap:
    expected: int
    found: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLag:
    """A request's lag on one rank, as its request_finished says: the median of how late it
    entered the request's collectives against its peers, in `group`."""

    at: float
    lag_s: float
    group: str


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
    run_started: ev.RunStarted | None
    path: tuple[str, ...]  # states entered, in order, starting at created
    spans: tuple[Span, ...]
    gate: ev.GateDecided | None
    plan: ev.PlanBuilt | None
    skip_reason: str | None
    warmup_records: tuple[ev.WarmupRecord, ...]
    action: ev.ActionStarted | None  # the action running now (started, not finished)
    action_at: float | None
    ready_action_done: bool
    errors: tuple[tuple[float, str, ev.Error], ...]  # (wall time, state, error)
    faults: tuple[tuple[float, str, ev.FaultInjected], ...]
    stalls: tuple[tuple[float, str, ev.Stalled], ...]
    live_buffer_bytes: int
    buffer_allocations: tuple[tuple[float, str, ev.BuffersAllocated], ...]
    buffer_drops: tuple[tuple[float, str, ev.BuffersDropped], ...]
    groups: tuple[GroupMark, ...]  # each group's progress, by name
    pending: OpenCollective | None
    heartbeats: int
    last_heartbeat_wall: float | None
    last_heartbeat_pending: PendingCollective | None
    requests_started: int
    requests_finished: int
    shutdown: ev.Shutdown | None
    unknown: tuple[ev.UnknownEvent, ...]
    seq_gaps: tuple[SeqGap, ...]
    dumps: tuple[tuple[float, str, ev.CollectivesDumped], ...]
    recent_starts: tuple[tuple[str, tuple[RecentStart, ...]], ...]  # per group, oldest first
    recent_heartbeats: tuple[float, ...]
    last_progress: float | None  # the last event that is neither a heartbeat nor a shutdown
    shutdown_wall: float | None
    clock: ev.ClockAligned | None  # its clock against rank 0's, measured at the rendezvous
    residency: tuple[tuple[float, str, ev.ResidencyEvent], ...] = ()  # the planner's steps
    flight_dumps: tuple[tuple[float, str, ev.FlightRecorderDumped], ...] = ()  # where they went
    aborts: tuple[tuple[float, str, ev.Aborted], ...] = ()  # a peer's failure that stopped it
    expectations: ev.Expectations | None = None  # each state's expected time, from history
    actions_done: tuple[ActionTime, ...] = ()  # before ready: each finished action, in order
    loads: tuple[tuple[float, str, ev.LoadEvent], ...] = ()  # each component load's steps
    compiles: tuple[tuple[float, str, ev.CompileEvent], ...] = ()  # compiled, artifact kept
    # gate-check's check of the ranks: environment, probe figures, slow
    rank_checks: tuple[tuple[float, str, ev.RankCheckEvent], ...] = ()
    lags: tuple[RequestLag, ...] = ()  # its latest requests' lags (fold.RECENT_LAGS)

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
