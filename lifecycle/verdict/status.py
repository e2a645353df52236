"""Per-rank status: the rules that say whether a rank is ready, running, blocked, hung,
crashed, stopped or failed, and the record of one rank's verdict (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lifecycle.core.errors import COLLECTIVE_KINDS
from lifecycle.core.format.states import SERVING_STATES, State
from lifecycle.core.format.view import RankView
from lifecycle.verdict.analysis import Run, RunAnalysis
from lifecycle.verdict.evidence import CutOff, FirstError

# A wait in a collective is a hang only once it outlasts this many heartbeat intervals (and
# HANG_FLOOR_S): a shorter one is a peer that is behind, or whose start is not journaled yet.
HANG_INTERVALS = 5
HANG_FLOOR_S = 2.0


class Status(StrEnum):
    READY = "ready"  # reached ready (and may have stopped cleanly since)
    FAILED = "failed"
    BLOCKED = "blocked"  # alive, waiting in a collective
    HUNG = "hung"  # alive, no progress, not in a collective
    CRASHED = "crashed"  # the journal ends: no heartbeat after its last event
    STOPPED = "stopped"  # shut down before ready
    RUNNING = "running"  # alive and progressing when the journal ends
    ABORTED = "aborted"  # stopped because a peer failed for good (the agreed abort)
    ABSENT = "absent"  # no event at all in the journals given


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingInfo:
    group: str
    group_seq: int
    op: str
    purpose: str
    since_s: float  # run time at which it started
    waited_s: float  # until the error that ended it, else until the rank's last event
    waiting_for: tuple[int, ...]  # members that never started it
    # Known from the rank's last heartbeat only (its record stayed in the ring after ready):
    # the rank may have moved on to the next sequence number within one heartbeat interval.
    from_heartbeat: bool = False
    # Known from PyTorch's Flight Recorder only: a collective the lifecycle did not record (a
    # pipeline's own), in a process group `group` names as torch does; `state` the rank's
    # state when it entered, `timeout_s` the group's timeout then.
    from_flight_recorder: bool = False
    state: str | None = None
    timeout_s: float | None = None
    caller: str | None = None  # "file.py:line function" that issued it, from the dump


@dataclass(frozen=True, slots=True, kw_only=True)
class RankVerdict:
    rank: int
    state: str  # the state its journal ends in
    last_state: str  # the state it was last working in (before a stop moved it on)
    status: Status
    pending: PendingInfo | None
    last_heartbeat_age_s: float | None
    first_error: FirstError | None
    faults: tuple[str, ...]  # the fault specs it journaled
    stalls: int
    stop_signal: str | None  # the signal it journaled its shutdown for, if one
    stop_reason: str | None  # the reason it journaled its shutdown with; None for no shutdown
    aborted: bool = False  # it stopped because a peer failed (the agreed abort), not on its own
    aborted_by: int | None = None  # the failed rank the abort named (None: none, or its store)


def rank_status(
    view: RankView,
    analysis: RunAnalysis[Run],
    *,
    now: float | None,
    dead: frozenset[int],
    live: frozenset[int] = frozenset(),
) -> Status:
    interval = analysis.heartbeat_interval_s
    # Silent for three heartbeat intervals (never less than half a second, for a thread that
    # waited on the GIL) means the process is gone.
    quiet = max(3 * interval, 0.5)
    last = view.last_wall or analysis.run.created_at
    current_stalled = bool(view.spans) and any(
        at >= view.spans[-1].entered_at for at, _, _ in view.stalls
    )
    progress = analysis.last_progress.get(view.rank, last)
    idle = last - progress > max(analysis.state_deadline_s, 10 * interval)
    if view.state == State.FAILED:
        if view.aborts and not any(error.fatal for _, _, error in view.errors):
            # A victim of the agreed abort (see endings.aborted_while_waiting).
            return Status.ABORTED
        return Status.FAILED
    if view.shutdown is not None or view.state == State.STOPPED:
        return _ended_status(view, analysis, last=last, hung=current_stalled or idle)
    reference = analysis.end_wall if now is None else max(now, analysis.end_wall)
    # Dead: its process is gone (seen by the reader on this host), silent for several
    # heartbeat intervals, or silent while peers heartbeat on (a live rank writes one every
    # interval from its own thread, blocked or not).
    # A rank the reader sees running (on this host) is not dead, however long its heartbeat
    # thread has been starved.
    silent = view.rank not in live and (
        reference - last > quiet or analysis.heartbeats_after(last, besides=view.rank) >= 2
    )
    if view.rank in dead or silent:
        return Status.CRASHED
    if view.ready_action_done and view.state in SERVING_STATES:
        # Serving: its collective records reach the journal in batches, so peers running
        # ahead of it are no sign of a cut-off journal.
        return Status.READY
    # Its peers finished collectives with it that it never journaled, and went on writing for
    # longer than a heartbeat interval: its journal was cut off. (Within that, each rank's
    # stream read a moment apart from the others' can show a peer a little ahead.)
    if (
        view.rank not in live
        and analysis.end_wall - last > quiet
        and cut_off(view, analysis) is not None
    ):
        return Status.CRASHED
    if view.pending is not None:
        # Alive: it is still waiting now, as far as the reader can tell.
        return Status.BLOCKED if stuck(view, analysis, until=reference) else Status.RUNNING
    if current_stalled or idle:
        return Status.HUNG
    return Status.RUNNING


def _ended_status(view: RankView, analysis: RunAnalysis[Run], *, last: float, hung: bool) -> Status:
    """A rank that journaled its end: ready if it got there; else stopped from outside before
    it was healthy, stuck first (a collective it had waited in too long, a stall in this
    state, no progress for long: `hung`), or simply stopped."""
    if view.ready_action_done:
        return Status.READY
    if stuck(view, analysis, until=last):
        return Status.BLOCKED
    return Status.HUNG if hung else Status.STOPPED


def hang_after_s(analysis: RunAnalysis[Run]) -> float:
    """How long a wait in a collective may last before it counts as a hang."""
    return max(HANG_INTERVALS * analysis.heartbeat_interval_s, HANG_FLOOR_S)


def stuck(view: RankView, analysis: RunAnalysis[Run], *, until: float) -> bool:
    """Waiting in a collective that cannot complete (its members disagree on it), or, until
    `until`, for longer than a peer that is merely behind would take."""
    pending = view.pending
    if pending is None:
        return False
    started = pending.started
    if any(
        m.group == started.group and m.group_seq == started.group_seq for m in analysis.mismatches
    ):
        return True
    return until - pending.at > hang_after_s(analysis)


def cut_off(view: RankView, analysis: RunAnalysis[Run]) -> CutOff | None:
    """A peer finished a collective with this rank that it never journaled starting: with
    write-ahead that only happens when the rank's journal lost its end."""
    for group in analysis.groups.values():
        if view.rank not in group.members:
            continue
        mine = group.started_by(view.rank)
        for member in group.members:
            if member != view.rank and group.finished_by(member) > mine:
                return CutOff(
                    rank=view.rank,
                    group=group.group,
                    started=mine,
                    peer=member,
                    peer_finished=group.finished_by(member),
                )
    return None


def pending_info(view: RankView, analysis: RunAnalysis[Run]) -> PendingInfo | None:
    pending = view.pending
    if pending is None:
        return None
    started = pending.started
    evidence = analysis.groups.get(started.group)
    waiting_for: tuple[int, ...] = ()
    if evidence is not None:
        waiting_for = tuple(
            m
            for m in evidence.members
            if m != view.rank and evidence.started_by(m) < started.group_seq
        )
    ended = next((at for at, _, e in view.errors if e.fatal and at >= pending.at), None)
    # A collective placed by a heartbeat carries no timeout of its own: the run's applies.
    timeout_s = analysis.dist_timeout_s if pending.from_heartbeat else started.timeout_s
    return PendingInfo(
        timeout_s=timeout_s if timeout_s else None,
        group=started.group,
        group_seq=started.group_seq,
        op=started.op,
        purpose=started.purpose,
        since_s=analysis.at(pending.at),
        waited_s=(ended or view.last_wall or pending.at) - pending.at,
        waiting_for=waiting_for,
        from_heartbeat=pending.from_heartbeat,
    )


def blocked(verdict: RankVerdict) -> bool:
    """Waiting in a collective at the end, or failed because one timed out or broke."""
    if verdict.pending is None or verdict.status is Status.STOPPED:
        return False
    if verdict.status is Status.BLOCKED or verdict.pending.from_flight_recorder:
        return True
    return verdict.first_error is not None and verdict.first_error.kind in COLLECTIVE_KINDS


def where(view: RankView) -> str:
    """The state a rank was last working in (before a stop from outside, or a peer's failure,
    moved it on)."""
    if len(view.path) > 1 and (
        view.state == State.STOPPED or (view.state == State.FAILED and view.aborts)
    ):
        return view.path[-2]
    return view.state


def stop_signal(view: RankView | None) -> str | None:
    if view is None or view.shutdown is None:
        return None
    return view.shutdown.signal
