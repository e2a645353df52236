"""The verdict on a run as data: outcome, culprit ranks and state, first error, each rank's
status and the evidence items they rest on (pure)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Generic

from lifecycle.core.errors import ErrorKind, recorded_kind
from lifecycle.core.format.records import shared_fields
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from lifecycle.verdict.analysis import GroupEvidence, Mismatch, Run, RunAnalysis, RunT, RunT_co
from lifecycle.verdict.culprits import late_arrivals
from lifecycle.verdict.endings import (
    Findings,
    aborted_while_waiting,
    broken_by_stop,
    ended_at_timeout,
    killed_together,
    stuck_when_killed,
)
from lifecycle.verdict.evidence import (
    AbortedBy,
    Blocked,
    ConnectionBroke,
    CrashedSilent,
    Evidence,
    FirstError,
    Mismatched,
    MissingRank,
    NeverEntered,
    NoProgress,
    PidDead,
    RankEvidence,
    ShutDown,
    StoppedBySignal,
    WaitEnd,
)
from lifecycle.verdict.outcome import Outcome, run_outcome
from lifecycle.verdict.rankchecks import rank_check_evidence
from lifecycle.verdict.status import (
    RankVerdict,
    Status,
    blocked,
    cut_off,
    pending_info,
    rank_status,
    stop_signal,
    where,
)

# Places ranks in collectives the journal does not show them in (PyTorch's Flight Recorder
# saw them there): each rank's verdict, updated.
Placement = Callable[[dict[int, RankVerdict]], dict[int, RankVerdict]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis(Generic[RunT_co]):
    run_id: str
    outcome: Outcome
    culprit_ranks: tuple[int, ...]
    culprit_state: str | None
    first_error: FirstError | None
    ranks: tuple[RankVerdict, ...]
    # Each rank's items in rank order (in the order they were found), then the run's own.
    evidence: tuple[Evidence, ...]
    groups: tuple[GroupEvidence, ...]
    mismatches: tuple[Mismatch, ...]
    missing_ranks: tuple[int, ...]
    startup_to_ready_s: float | None
    analysis: RunAnalysis[RunT_co]

    @property
    def first_error_by_a_victim(self) -> bool:
        """The first error was journaled by a rank that is not a culprit: it failed because
        of what a culprit did (its collective timed out waiting on one), not of itself."""
        return self.first_error is not None and self.first_error.rank not in self.culprit_ranks

    def verdict_of(self, rank: int) -> RankVerdict | None:
        return next((v for v in self.ranks if v.rank == rank), None)

    def about(self, rank: int) -> tuple[RankEvidence, ...]:
        """The evidence items about `rank`, in the order they were found."""
        return tuple(e for e in self.evidence if isinstance(e, RankEvidence) and e.rank == rank)


def _first_error(view: RankView, analysis: RunAnalysis[Run]) -> FirstError | None:
    for at, state, error in view.errors:
        if error.fatal:
            return FirstError(
                rank=view.rank,
                kind=recorded_kind(error.error_kind),
                error_type=error.error_type,
                message=error.message,
                state=state,
                at_s=analysis.at(at),
            )
    return None


def _verdict(
    view: RankView,
    analysis: RunAnalysis[Run],
    findings: Findings,
    *,
    now: float | None,
    dead: frozenset[int],
    live: frozenset[int] = frozenset(),
) -> RankVerdict:
    status = rank_status(view, analysis, now=now, dead=dead, live=live)
    error = _first_error(view, analysis)
    found = findings.setdefault(view.rank, [])
    if error is not None:
        found.append(error)
    if status is Status.CRASHED:
        found.append(CrashedSilent(rank=view.rank, last_event_s=analysis.at(view.last_wall or 0.0)))
        lost = cut_off(view, analysis)
        if view.rank in dead and view.run_started is not None:
            found.append(PidDead(rank=view.rank, pid=view.run_started.pid))
        elif lost is not None:
            found.append(lost)
    signal = stop_signal(view)
    if status is Status.STOPPED:
        if signal is not None:
            found.append(StoppedBySignal(rank=view.rank, signal=signal, state=where(view)))
        else:
            reason = view.shutdown.reason if view.shutdown is not None else None
            found.append(ShutDown(rank=view.rank, reason=reason, state=where(view)))
    if status is Status.HUNG:
        found.append(NoProgress(rank=view.rank, state=view.state))
    for _, _, aborted in view.aborts[:1]:
        found.append(
            AbortedBy(
                rank=view.rank,
                failed_rank=aborted.failed_rank,
                error_type=aborted.error_type,
                state=where(view),
                learned_after_s=aborted.learned_after_s,
                announced_by=aborted.announced_by,
            )
        )
    return RankVerdict(
        rank=view.rank,
        state=view.state,
        last_state=where(view),
        status=status,
        pending=pending_info(view, analysis),
        last_heartbeat_age_s=None
        if view.last_heartbeat_wall is None
        else analysis.end_wall - view.last_heartbeat_wall,
        first_error=error,
        faults=tuple(f.fault for _, _, f in view.faults),
        stalls=len(view.stalls),
        stop_signal=signal,
        stop_reason=view.shutdown.reason if view.shutdown is not None else None,
        aborted=bool(view.aborts) and error is None,
        aborted_by=view.aborts[0][2].failed_rank if view.aborts else None,
    )


def _peer_evidence(verdicts: dict[int, RankVerdict], findings: Findings) -> dict[int, RankVerdict]:
    """What blocked ranks say of the peers they waited for.

    A peer whose connection broke under a waiting rank, and that journaled no end of its own,
    died (crashed). A peer that others waited for while it was alive and not in that
    collective, and that was then stopped from outside, or by the agreed abort of the waiting
    rank's own failure (its wait ran out), was hung. A peer the abort of another rank's failure
    stopped before it got to the collective is that failure's victim, as the waiting rank is.
    """
    updated = dict(verdicts)
    for verdict in verdicts.values():
        if verdict.pending is None or not blocked(verdict):
            continue
        broken = verdict.first_error is not None and verdict.first_error.kind is ErrorKind.PEER_GONE
        for peer in verdict.pending.waiting_for:
            other = updated.get(peer)
            if other is None or other.pending is not None:
                continue
            if broken and other.status in (Status.RUNNING, Status.BLOCKED):
                updated[peer] = replace(other, status=Status.CRASHED)
                findings[peer].append(ConnectionBroke(rank=peer, peer=verdict.rank))
            elif other.status in (Status.STOPPED, Status.RUNNING) or (
                other.status is Status.ABORTED and other.aborted_by in (verdict.rank, None)
            ):
                updated[peer] = replace(other, status=Status.HUNG)
                findings[peer].append(
                    NeverEntered(
                        rank=peer,
                        peer=verdict.rank,
                        group=verdict.pending.group,
                        group_seq=verdict.pending.group_seq,
                    )
                )
    return updated


def _blocked_evidence(verdict: RankVerdict) -> Blocked | None:
    p = verdict.pending
    if p is None or not blocked(verdict):
        return None
    error = verdict.first_error
    # A wait that lasted its group's timeout ended there: in an error the rank journaled (a
    # wait only the Flight Recorder saw), or with the process (NCCL's watchdog).
    outlasted = p.timeout_s is not None and p.waited_s >= 0.9 * p.timeout_s
    timed_out = error is not None and error.kind is ErrorKind.COLLECTIVE_TIMEOUT
    if error is None and verdict.aborted:
        ended = WaitEnd.ABORTED
    elif error is None and not outlasted:
        ended = WaitEnd.WAITING
    elif timed_out or (outlasted and (error is None or p.from_flight_recorder)):
        ended = WaitEnd.TIMED_OUT
    else:
        ended = WaitEnd.BROKE
    return Blocked(rank=verdict.rank, ended=ended, **shared_fields(p, Blocked))


def diagnose(
    analysis: RunAnalysis[RunT],
    *,
    now: float | None = None,
    dead_ranks: frozenset[int] = frozenset(),
    live_ranks: frozenset[int] = frozenset(),
    in_flight: Placement | None = None,
) -> Diagnosis[RunT]:
    """Decide the outcome and the culprits from the evidence alone.

    `now` (the reader's clock) only matters for a journal whose ranks all stopped writing
    together: without it, a journal that simply ends reads as crashed only relative to the
    other ranks. `dead_ranks` are ranks whose process the reader saw gone: one of them that
    journaled no end crashed, however recent its last event; `live_ranks` those it saw
    running: silence alone does not make one of them crashed. `in_flight` places ranks in the
    collectives only PyTorch's Flight Recorder saw.
    """
    findings: Findings = {}
    verdicts, killed = _rank_verdicts(
        analysis, findings, now=now, dead=dead_ranks, live=live_ranks, in_flight=in_flight
    )
    errors = _run_errors(verdicts)
    outcome, culprits = run_outcome(verdicts, analysis, errors, killed=killed)
    culprit_state = _culprit_state(verdicts, culprits)
    startup = _startup_to_ready(analysis)
    return Diagnosis(
        run_id=analysis.run.run_id,
        outcome=outcome,
        culprit_ranks=tuple(culprits),
        culprit_state=culprit_state,
        first_error=errors[0] if errors else None,
        ranks=tuple(verdicts[r] for r in sorted(verdicts)),
        evidence=_evidence(verdicts, analysis, findings),
        groups=tuple(analysis.groups.values()),
        mismatches=analysis.mismatches,
        missing_ranks=analysis.missing_ranks,
        startup_to_ready_s=startup,
        analysis=analysis,
    )


def _rank_verdicts(
    analysis: RunAnalysis[Run],
    findings: Findings,
    *,
    now: float | None,
    dead: frozenset[int],
    live: frozenset[int],
    in_flight: Placement | None,
) -> tuple[dict[int, RankVerdict], bool]:
    """Each rank's verdict, from its own journal and then from what the others say of it, and
    whether the ranks were killed together."""
    verdicts = {
        r: _verdict(v, analysis, findings, now=now, dead=dead, live=live)
        for r, v in analysis.views.items()
    }
    verdicts = ended_at_timeout(verdicts, analysis, findings)
    verdicts = aborted_while_waiting(verdicts, analysis)
    killed = killed_together(verdicts, analysis)
    if killed:
        verdicts = stuck_when_killed(verdicts, analysis)
    if in_flight is not None:
        verdicts = in_flight(verdicts)
    verdicts = _peer_evidence(verdicts, findings)
    verdicts = broken_by_stop(verdicts, analysis, findings)
    return verdicts, killed


def _run_errors(verdicts: dict[int, RankVerdict]) -> list[FirstError]:
    """Each rank's first error, earliest first, but for ranks stopped from outside."""
    return sorted(
        (
            v.first_error
            for v in verdicts.values()
            if v.first_error is not None and v.status is not Status.STOPPED
        ),
        key=lambda e: (e.at_s, e.rank),
    )


def _culprit_state(verdicts: dict[int, RankVerdict], culprits: list[int]) -> str | None:
    """Where the lead culprit went wrong: the state of its first error, else its last state."""
    if culprits:
        lead = verdicts.get(culprits[0])
        if lead is not None:
            return lead.first_error.state if lead.first_error else lead.last_state
    return None


def _startup_to_ready(analysis: RunAnalysis[Run]) -> float | None:
    """From the run's creation to its last rank ready, when every rank got there."""
    ready_times = [
        v.entered_at(State.READY.value)
        for v in analysis.views.values()
        if State.READY.value in v.path
    ]
    return (
        max(t for t in ready_times if t is not None) - analysis.run.created_at
        if ready_times and len(ready_times) == analysis.run.world_size
        else None
    )


def _evidence(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run], findings: Findings
) -> tuple[Evidence, ...]:
    """Each rank's items in rank order (what it was found with, then its wait), then the
    run's own: who came late, mismatched collectives, missing ranks."""
    evidence: list[Evidence] = []
    for rank in sorted(verdicts):
        evidence.extend(findings.get(rank, ()))
        waiting = _blocked_evidence(verdicts[rank])
        if waiting is not None:
            evidence.append(waiting)
    evidence.extend(late_arrivals(verdicts, analysis).values())
    evidence.extend(
        Mismatched(
            group=m.group,
            group_seq=m.group_seq,
            ranks=tuple(rank for rank, _ in m.by_rank),
            reason=m.reason,
            split=m.split,
        )
        for m in analysis.mismatches
    )
    evidence.extend(MissingRank(rank=rank) for rank in analysis.missing_ranks)
    evidence.extend(rank_check_evidence(analysis.views))
    return tuple(evidence)
