"""The verdict on a run: outcome, culprit ranks and state, first error, and the evidence (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lifecycle.core.fold import RankView
from lifecycle.core.states import State
from replay.analysis import GroupEvidence, Mismatch, RunAnalysis

COLLECTIVE_ERRORS = frozenset({"CollectiveTimeout", "CollectiveError"})
# A wait in a collective is a hang only once it outlasts this many heartbeat intervals (and
# HANG_FLOOR_S): a shorter one is a peer that is behind, or whose start is not journaled yet.
HANG_INTERVALS = 5
HANG_FLOOR_S = 2.0

EXIT_READY = 0
EXIT_FAILURE = 1  # failed, hung or crashed
EXIT_NOT_READY = 3  # no failure found, and not ready: running, stopped, or incomplete


class Outcome(StrEnum):
    READY = "ready"
    FAILED = "failed"
    HUNG = "hung"
    CRASHED = "crashed"
    STOPPED = "stopped"  # stopped from outside before ready, with no failure before the stop
    RUNNING = "running"  # still starting: every rank alive and moving
    INCOMPLETE = "incomplete"  # the journals end before a verdict (a rank's journal missing)


class Status(StrEnum):
    READY = "ready"  # reached ready (and may have stopped cleanly since)
    FAILED = "failed"
    BLOCKED = "blocked"  # alive, waiting in a collective
    HUNG = "hung"  # alive, no progress, not in a collective
    CRASHED = "crashed"  # the journal ends: no heartbeat after its last event
    STOPPED = "stopped"  # shut down before ready
    RUNNING = "running"  # alive and progressing when the journal ends
    ABSENT = "absent"  # no event at all in the journals given


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorInfo:
    rank: int
    error_type: str
    message: str
    state: str
    at_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingInfo:
    group: str
    group_seq: int
    op: str
    purpose: str
    since_s: float  # run time at which it started
    waited_s: float  # until the rank's last event
    waiting_for: tuple[int, ...]  # members that never started it


@dataclass(frozen=True, slots=True, kw_only=True)
class RankVerdict:
    rank: int
    last_state: str
    status: Status
    pending: PendingInfo | None
    last_heartbeat_age_s: float | None
    first_error: ErrorInfo | None
    faults: tuple[str, ...]
    stalls: int
    note: str
    stop_signal: str | None  # the signal it journaled its shutdown for, if one


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    run_id: str
    outcome: Outcome
    culprit_ranks: tuple[int, ...]
    culprit_state: str | None
    first_error: ErrorInfo | None
    summary: str
    ranks: tuple[RankVerdict, ...]
    groups: tuple[GroupEvidence, ...]
    mismatches: tuple[Mismatch, ...]
    missing_ranks: tuple[int, ...]
    startup_to_ready_s: float | None
    analysis: RunAnalysis

    @property
    def exit_status(self) -> int:
        if self.outcome is Outcome.READY:
            return EXIT_READY
        if self.outcome in (Outcome.FAILED, Outcome.HUNG, Outcome.CRASHED):
            return EXIT_FAILURE
        return EXIT_NOT_READY


def _first_fatal(view: RankView) -> tuple[float, str, str, str] | None:
    for at, state, error in view.errors:
        if error.fatal:
            return at, state, error.error_type, error.message
    return None


def _reached_ready(view: RankView) -> bool:
    return State.READY.value in view.path


def _where(view: RankView) -> str:
    """The state a rank was last working in (before a stop from outside moved it on)."""
    if view.state == State.STOPPED and len(view.path) > 1:
        return view.path[-2]
    return view.state


def _status(
    view: RankView, analysis: RunAnalysis, *, now: float | None, dead: frozenset[int]
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
        return Status.FAILED
    ended = view.shutdown is not None or view.state == State.STOPPED
    if ended and view.ready_action_done:
        return Status.READY
    if ended:
        # Stopped from outside before it was healthy: stuck first (a collective it had waited
        # in too long, a stall in this state, no progress for long), or simply stopped.
        if _stuck(view, analysis, until=last):
            return Status.BLOCKED
        return Status.HUNG if current_stalled or idle else Status.STOPPED
    reference = analysis.end_wall if now is None else max(now, analysis.end_wall)
    # Dead: its process is gone (seen by the reader on this host), silent for several
    # heartbeat intervals, or silent while peers heartbeat on (a live rank writes one every
    # interval from its own thread, blocked or not).
    if (
        view.rank in dead
        or reference - last > quiet
        or analysis.heartbeats_after(last, besides=view.rank) >= 2
    ):
        return Status.CRASHED
    if view.ready_action_done and view.state == State.READY:
        # Serving: its collective records reach the journal in batches, so peers running
        # ahead of it are no sign of a cut-off journal.
        return Status.READY
    # Its peers finished collectives with it that it never journaled, and went on writing for
    # longer than a heartbeat interval: its journal was cut off. (Within that, each rank's
    # stream read a moment apart from the others' can show a peer a little ahead.)
    if analysis.end_wall - last > quiet and _cut_off(view, analysis):
        return Status.CRASHED
    if view.pending is not None:
        # Alive: it is still waiting now, as far as the reader can tell.
        return Status.BLOCKED if _stuck(view, analysis, until=reference) else Status.RUNNING
    if current_stalled or idle:
        return Status.HUNG
    return Status.RUNNING


def _stop_cause(view: RankView) -> str:
    shutdown = view.shutdown
    if shutdown is None:
        return "from outside"
    return f"by {shutdown.signal}" if shutdown.signal else f"({shutdown.reason})"


def _hang_after_s(analysis: RunAnalysis) -> float:
    """How long a wait in a collective may last before it counts as a hang."""
    return max(HANG_INTERVALS * analysis.heartbeat_interval_s, HANG_FLOOR_S)


def _stuck(view: RankView, analysis: RunAnalysis, *, until: float) -> bool:
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
    return until - pending.at > _hang_after_s(analysis)


def _cut_off(view: RankView, analysis: RunAnalysis) -> bool:
    """Peers finished a collective with this rank that it never journaled starting: with
    write-ahead that only happens when the rank's journal lost its end."""
    for group in analysis.groups.values():
        if view.rank not in group.members:
            continue
        mine = group.started_by(view.rank)
        if any(group.finished_by(m) > mine for m in group.members if m != view.rank):
            return True
    return False


def _pending(view: RankView, analysis: RunAnalysis) -> PendingInfo | None:
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
    # Waited until the error that ended it, else until the rank's journal ends.
    ended = next((at for at, _, e in view.errors if e.fatal and at >= pending.at), None)
    return PendingInfo(
        group=started.group,
        group_seq=started.group_seq,
        op=started.op,
        purpose=started.purpose,
        since_s=analysis.at(pending.at),
        waited_s=(ended or view.last_wall or pending.at) - pending.at,
        waiting_for=waiting_for,
    )


def _verdict(
    view: RankView, analysis: RunAnalysis, *, now: float | None, dead: frozenset[int]
) -> RankVerdict:
    status = _status(view, analysis, now=now, dead=dead)
    fatal = _first_fatal(view)
    error = (
        ErrorInfo(
            rank=view.rank,
            error_type=fatal[2],
            message=fatal[3],
            state=fatal[1],
            at_s=analysis.at(fatal[0]),
        )
        if fatal
        else None
    )
    pending = _pending(view, analysis)
    heartbeat_age = (
        None if view.last_heartbeat_wall is None else analysis.end_wall - view.last_heartbeat_wall
    )
    notes = []
    if pending is not None:
        who = (
            "waiting for " + ", ".join(f"rank {m}" for m in pending.waiting_for)
            if pending.waiting_for
            else "every member entered it"
        )
        notes.append(
            f"in {pending.op} #{pending.group_seq} of {pending.group} ({pending.purpose}) since"
            f" +{pending.since_s:.2f} s, {who}"
        )
    if error is not None:
        notes.append(f"{error.error_type} in {error.state}: {error.message}")
    if status is Status.CRASHED:
        notes.append(
            f"journal ends at +{analysis.at(view.last_wall or 0.0):.2f} s with no heartbeat after"
        )
        if view.rank in dead and view.run_started is not None:
            notes.append(f"its process (pid {view.run_started.pid}) is gone")
        elif _cut_off(view, analysis):
            notes.append("its peers finished collectives with it that it never journaled")
    if status is Status.STOPPED:
        notes.append(f"stopped {_stop_cause(view)} in {_where(view)}")
    if status is Status.HUNG:
        notes.append(f"no progress in {view.state}, heartbeats go on")
    return RankVerdict(
        rank=view.rank,
        last_state=_where(view),
        status=status,
        pending=pending,
        last_heartbeat_age_s=heartbeat_age,
        first_error=error,
        faults=tuple(f.fault for _, _, f in view.faults),
        stalls=len(view.stalls),
        note="; ".join(notes),
        stop_signal=_stop_signal(view),
    )


_PEER_GONE = ("closed by peer", "reset by peer", "connection closed", "connection reset")


def _peer_evidence(verdicts: dict[int, RankVerdict]) -> dict[int, RankVerdict]:
    """What blocked ranks say of the peers they waited for.

    A peer whose connection broke under a waiting rank, and that journaled no end of its own,
    died (crashed). A peer that others waited for while it was alive and not in that
    collective, and that was then stopped from outside, was hung.
    """
    from dataclasses import replace

    updated = dict(verdicts)
    for verdict in verdicts.values():
        if verdict.pending is None or not _blocked(verdict):
            continue
        broken = verdict.first_error is not None and any(
            marker in verdict.first_error.message.lower() for marker in _PEER_GONE
        )
        for peer in verdict.pending.waiting_for:
            other = updated.get(peer)
            if other is None or other.pending is not None:
                continue
            if broken and other.status in (Status.RUNNING, Status.BLOCKED):
                updated[peer] = replace(
                    other,
                    status=Status.CRASHED,
                    note=(other.note + "; " if other.note else "")
                    + f"its connection broke under rank {verdict.rank}",
                )
            elif other.status in (Status.STOPPED, Status.RUNNING):
                updated[peer] = replace(
                    other,
                    status=Status.HUNG,
                    note=(other.note + "; " if other.note else "")
                    + f"rank {verdict.rank} waited for it in {verdict.pending.group}"
                    f" #{verdict.pending.group_seq}, which it never entered",
                )
    return updated


def _blocked(verdict: RankVerdict) -> bool:
    """Waiting in a collective at the end, or failed because one timed out or broke."""
    if verdict.pending is None or verdict.status is Status.STOPPED:
        return False
    if verdict.status is Status.BLOCKED:
        return True
    return verdict.first_error is not None and verdict.first_error.error_type in COLLECTIVE_ERRORS


def _broken_by_stop(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis
) -> dict[int, RankVerdict]:
    """A rank whose collective broke only after the run was stopped by a signal, and that was
    itself stopped by one, failed because of the stop (a peer left first), not on its own."""
    from dataclasses import replace

    signalled = [
        wall
        for rank, wall in analysis.shutdown_walls.items()
        if _stop_signal(analysis.views.get(rank)) is not None
    ]
    if not signalled:
        return verdicts
    stopped_at = analysis.at(min(signalled))
    updated = dict(verdicts)
    for rank, verdict in verdicts.items():
        error = verdict.first_error
        if (
            verdict.status is Status.FAILED
            and error is not None
            and error.error_type in COLLECTIVE_ERRORS
            and error.at_s >= stopped_at
            and _stop_signal(analysis.views.get(rank)) is not None
        ):
            updated[rank] = replace(
                verdict,
                status=Status.STOPPED,
                note=verdict.note + "; its collective broke once the run was being stopped",
            )
    return updated


def _stop_signal(view: RankView | None) -> str | None:
    if view is None or view.shutdown is None:
        return None
    return view.shutdown.signal


def _wait_roots(verdicts: dict[int, RankVerdict], missing: tuple[int, ...]) -> list[int]:
    """Follow 'waits for' from every blocked rank to the ranks that are not blocked."""
    roots: list[int] = []
    seen: set[int] = set()
    frontier = [r for r, v in verdicts.items() if _blocked(v)]
    while frontier:
        rank = frontier.pop()
        if rank in seen:
            continue
        seen.add(rank)
        verdict = verdicts.get(rank)
        if verdict is None:
            if rank in missing and rank not in roots:
                roots.append(rank)
            continue
        if not _blocked(verdict):
            if rank not in roots:
                roots.append(rank)
            continue
        assert verdict.pending is not None
        frontier.extend(verdict.pending.waiting_for)
    return roots


@dataclass(frozen=True, slots=True, kw_only=True)
class Late:
    """A rank that entered a collective only after a peer had given up waiting there."""

    rank: int
    group: str
    group_seq: int
    entered_s: float
    peer: int
    peer_gave_up_s: float


def _late_arrivals(verdicts: dict[int, RankVerdict], analysis: RunAnalysis) -> dict[int, Late]:
    late: dict[int, Late] = {}
    for verdict in verdicts.values():
        p, e = verdict.pending, verdict.first_error
        if p is None or e is None or e.error_type != "CollectiveTimeout":
            continue
        evidence = analysis.groups.get(p.group)
        if evidence is None:
            continue
        for member in evidence.members:
            entered = evidence.started_at(member, p.group_seq)
            if member == verdict.rank or entered is None:
                continue
            if analysis.at(entered) > e.at_s and member not in late:
                late[member] = Late(
                    rank=member,
                    group=p.group,
                    group_seq=p.group_seq,
                    entered_s=analysis.at(entered),
                    peer=verdict.rank,
                    peer_gave_up_s=e.at_s,
                )
    return late


def _hang_culprits(verdicts: dict[int, RankVerdict], analysis: RunAnalysis) -> list[int]:
    roots = _wait_roots(verdicts, analysis.missing_ranks)
    if roots:
        return sorted(roots, key=lambda r: _when_wrong(verdicts.get(r), analysis))
    # Nobody missing, yet a member timed out: a peer came to that collective too late (after
    # the timeout), and is the one that went wrong first.
    late = _late_arrivals(verdicts, analysis)
    if late:
        return sorted(late, key=lambda r: late[r].entered_s)
    # Everyone waits on someone who waits too: a cycle, or members stuck in different
    # collectives at the same sequence number. A rank with a fault injected says so itself;
    # else a minority signature at a mismatched sequence number; else the rank that went past
    # the point where the others are stuck (its pending collective started last) skipped or
    # reordered a collective.
    faulted = [r for r, v in verdicts.items() if v.faults and _blocked(v)]
    if faulted:
        return sorted(faulted)
    odd = _mismatch_minorities(analysis.mismatches)
    if odd:
        return sorted(odd)
    blocked = [v for v in verdicts.values() if _blocked(v) and v.pending is not None]
    if blocked:
        latest = max(blocked, key=lambda v: v.pending.since_s if v.pending else 0.0)
        return [latest.rank]
    return [r for r, v in verdicts.items() if v.status is Status.HUNG]


def _mismatch_minorities(mismatches: tuple[Mismatch, ...]) -> set[int]:
    odd: set[int] = set()
    for mismatch in mismatches:
        counts: dict[object, list[int]] = {}
        for rank, sig in mismatch.by_rank:
            counts.setdefault((sig.op, sig.purpose, sig.dtype, sig.shapes), []).append(rank)
        groups = sorted(counts.values(), key=len)
        if len(groups) > 1 and len(groups[0]) < len(groups[-1]):
            odd.update(groups[0])
    return odd


def _when_wrong(verdict: RankVerdict | None, analysis: RunAnalysis) -> float:
    if verdict is None:
        return float("inf")
    if verdict.first_error is not None:
        return verdict.first_error.at_s
    return analysis.at(analysis.last_progress.get(verdict.rank, analysis.end_wall))


def diagnose(
    analysis: RunAnalysis, *, now: float | None = None, dead_ranks: frozenset[int] = frozenset()
) -> Diagnosis:
    """Decide the outcome and the culprits from the evidence alone.

    `now` (the reader's clock) only matters for a journal whose ranks all stopped writing
    together: without it, a journal that simply ends reads as crashed only relative to the
    other ranks. `dead_ranks` are ranks whose process the reader saw gone: one of them that
    journaled no end crashed, however recent its last event.
    """
    verdicts = {
        r: _verdict(v, analysis, now=now, dead=dead_ranks) for r, v in analysis.views.items()
    }
    verdicts = _peer_evidence(verdicts)
    verdicts = _broken_by_stop(verdicts, analysis)
    errors = sorted(
        (
            v.first_error
            for v in verdicts.values()
            if v.first_error is not None and v.status is not Status.STOPPED
        ),
        key=lambda e: (e.at_s, e.rank),
    )
    first_error = errors[0] if errors else None
    crashed = [r for r, v in verdicts.items() if v.status is Status.CRASHED]
    failed = [r for r, v in verdicts.items() if v.status is Status.FAILED]
    statuses = {v.status for v in verdicts.values()}
    hung_evidence = any(_blocked(v) for v in verdicts.values()) or Status.HUNG in statuses
    complete = bool(verdicts) and not analysis.missing_ranks
    culprits: list[int] = []
    if crashed:
        outcome = Outcome.CRASHED
        culprits = sorted(crashed, key=lambda r: analysis.views[r].last_wall or 0.0)
    elif complete and statuses == {Status.READY}:
        outcome = Outcome.READY
    elif hung_evidence:
        outcome = Outcome.HUNG
        culprits = _hang_culprits(verdicts, analysis)
    elif errors or failed:
        outcome = Outcome.FAILED
        culprits = [errors[0].rank] if errors else failed[:1]
    elif complete and statuses <= {Status.READY, Status.STOPPED}:
        outcome = Outcome.STOPPED
    elif complete and statuses <= {Status.READY, Status.STOPPED, Status.RUNNING}:
        outcome = Outcome.RUNNING
    else:
        outcome = Outcome.INCOMPLETE
    culprit_state = None
    if culprits:
        lead = verdicts.get(culprits[0])
        if lead is not None:
            culprit_state = lead.first_error.state if lead.first_error else lead.last_state
    ready_times = [
        v.entered_at(State.READY.value) for v in analysis.views.values() if _reached_ready(v)
    ]
    startup = (
        max(t for t in ready_times if t is not None) - analysis.run.created_at
        if ready_times and len(ready_times) == analysis.run.world_size
        else None
    )
    diagnosis = Diagnosis(
        run_id=analysis.run.run_id,
        outcome=outcome,
        culprit_ranks=tuple(culprits),
        culprit_state=culprit_state,
        first_error=first_error,
        summary="",
        ranks=tuple(verdicts[r] for r in sorted(verdicts)),
        groups=tuple(analysis.groups.values()),
        mismatches=analysis.mismatches,
        missing_ranks=analysis.missing_ranks,
        startup_to_ready_s=startup,
        analysis=analysis,
    )
    return _with_summary(diagnosis, verdicts)


def _with_summary(d: Diagnosis, verdicts: dict[int, RankVerdict]) -> Diagnosis:
    from dataclasses import replace

    return replace(d, summary=summarize(d, verdicts))


def _stopped_text(verdict: RankVerdict, analysis: RunAnalysis) -> str:
    if verdict.status is Status.READY:
        return f"rank {verdict.rank} ready"
    view = analysis.views.get(verdict.rank)
    if verdict.status is Status.STOPPED and view is not None:
        return f"rank {verdict.rank} {_stop_cause(view)} in {verdict.last_state}"
    return f"rank {verdict.rank} {verdict.status} in {verdict.last_state}"


def _running_text(verdict: RankVerdict) -> str:
    if verdict.status is not Status.RUNNING:
        return f"rank {verdict.rank} {verdict.status}"
    text = f"rank {verdict.rank} in {verdict.last_state}"
    p = verdict.pending
    if p is not None:
        text += f" ({p.op} #{p.group_seq} of {p.group} for {p.waited_s:.1f} s)"
    return text


def summarize(d: Diagnosis, verdicts: dict[int, RankVerdict]) -> str:
    """One paragraph a person reads first."""
    parts: list[str] = []
    if d.outcome is Outcome.READY:
        parts.append(f"every rank reached ready in {d.startup_to_ready_s or 0.0:.2f} s")
    elif d.outcome is Outcome.STOPPED:
        parts.append(
            "stopped from outside before ready: "
            + ", ".join(_stopped_text(v, d.analysis) for v in d.ranks)
        )
    elif d.outcome is Outcome.RUNNING:
        parts.append("still starting: " + ", ".join(_running_text(v) for v in d.ranks))
    elif d.outcome is Outcome.INCOMPLETE:
        states = ", ".join(f"rank {v.rank} {v.last_state} ({v.status})" for v in d.ranks)
        parts.append(f"the journal ends before a verdict: {states}")
    late = _late_arrivals(verdicts, d.analysis) if d.outcome is Outcome.HUNG else {}
    for rank in d.culprit_ranks:
        verdict = verdicts.get(rank)
        if verdict is None:
            parts.append(f"rank {rank} left no journal")
            continue
        if rank in late:
            lag = late[rank]
            parts.append(
                f"rank {rank} came late to {lag.group} #{lag.group_seq}: it entered at"
                f" +{lag.entered_s:.2f} s, after rank {lag.peer} had given up waiting there at"
                f" +{lag.peer_gave_up_s:.2f} s"
            )
        elif verdict.first_error is not None:
            e = verdict.first_error
            first = d.first_error is not None and d.first_error.rank == rank
            parts.append(
                f"rank {rank} failed {'first, ' if first else ''}in {e.state} at"
                f" +{e.at_s:.2f} s: {e.error_type}: {e.message}"
            )
        elif verdict.status is Status.CRASHED:
            parts.append(f"rank {rank} crashed in {verdict.last_state} ({verdict.note})")
        elif verdict.status is Status.HUNG:
            parts.append(f"rank {rank} hung in {verdict.last_state}, heartbeats going on")
        elif verdict.pending is not None:
            p = verdict.pending
            parts.append(
                f"rank {rank} went on to {p.op} #{p.group_seq} of {p.group} ({p.purpose})"
                f" while its peers waited for it in an earlier collective"
            )
        else:
            parts.append(f"rank {rank} in {verdict.last_state}")
        if verdict.faults:
            parts.append(f"(fault injected: {', '.join(verdict.faults)})")
    blocked = [v for v in d.ranks if v.rank not in d.culprit_ranks and _blocked(v)]
    if blocked:
        lines = []
        for v in blocked:
            assert v.pending is not None
            p = v.pending
            waits = (
                "waiting for rank "
                + ", ".join(
                    f"{m} (itself blocked)" if m in verdicts and _blocked(verdicts[m]) else str(m)
                    for m in p.waiting_for
                )
                if p.waiting_for
                else "every member had entered it"
            )
            if v.first_error is None:
                ended = f"still waiting after {p.waited_s:.1f} s"
            elif v.first_error.error_type == "CollectiveTimeout":
                ended = f"timed out after {p.waited_s:.1f} s"
            else:
                ended = f"broke after {p.waited_s:.1f} s ({v.first_error.error_type})"
            lines.append(
                f"rank {v.rank} in {p.op} #{p.group_seq} of {p.group} ({p.purpose}),"
                f" {waits}, {ended}"
            )
        parts.append("then blocked: " + "; ".join(lines))
    if d.mismatches:
        m = d.mismatches[0]
        parts.append(f"mismatch at {m.group} #{m.group_seq}: {m.reason}")
    if d.missing_ranks:
        parts.append("no journal for rank " + ", ".join(map(str, d.missing_ranks)))
    return f"{d.outcome.value}: " + "; ".join(parts)
