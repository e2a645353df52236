"""How ranks' ends are read before a verdict: a whole job killed at once, a rank ended by
NCCL's watchdog as its collective timed out, a collective broken by a stop (pure)."""

from __future__ import annotations

from dataclasses import replace

from lifecycle.core.errors import COLLECTIVE_KINDS
from lifecycle.verdict.analysis import Run, RunAnalysis
from lifecycle.verdict.evidence import BrokenByStop, EndedAtTimeout, RankEvidence
from lifecycle.verdict.status import RankVerdict, Status, stop_signal, stuck

# What each rank's verdict rests on, as it is found; ranks' lists grow as peers testify.
Findings = dict[int, list[RankEvidence]]


def broken_by_stop(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run], findings: Findings
) -> dict[int, RankVerdict]:
    """A rank whose collective broke only after the run was stopped by a signal, and that was
    itself stopped by one, failed because of the stop (a peer left first), not on its own."""
    signalled = [
        wall
        for rank, wall in analysis.shutdown_walls.items()
        if stop_signal(analysis.views.get(rank)) is not None
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
            and error.kind in COLLECTIVE_KINDS
            and error.at_s >= stopped_at
            and stop_signal(analysis.views.get(rank)) is not None
        ):
            updated[rank] = replace(verdict, status=Status.STOPPED)
            findings[rank].append(BrokenByStop(rank=rank, at_s=error.at_s, stopped_at_s=stopped_at))
    return updated


def ended_at_timeout(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run], findings: Findings
) -> dict[int, RankVerdict]:
    """A rank whose journal ends, with no error, in a collective that peers never entered,
    just as that collective's timeout ran out, was ended by NCCL's watchdog while it waited:
    it is blocked there, not the rank that went wrong."""
    updated = dict(verdicts)
    slack = max(2 * analysis.heartbeat_interval_s, 1.0)  # its last heartbeat before the end
    for rank, verdict in verdicts.items():
        p = verdict.pending
        if (
            verdict.status is Status.CRASHED
            and verdict.first_error is None
            and p is not None
            and p.waiting_for
            and p.timeout_s is not None
            and p.waited_s + slack >= p.timeout_s
        ):
            updated[rank] = replace(verdict, status=Status.BLOCKED)
            findings[rank].append(
                EndedAtTimeout(rank=rank, waited_s=p.waited_s, timeout_s=p.timeout_s)
            )
    return updated


def aborted_while_waiting(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run]
) -> dict[int, RankVerdict]:
    """A rank the agreed abort stopped while it waited in a collective a peer never entered,
    having waited there longer than a peer merely behind would take before the failure it
    was aborted by, was blocked there, waiting on that peer, as a rank its collective's
    timeout ended was (a new ending beside ended-at-timeout): the verdict follows the wait to
    the culprit. One that came to the collective only about as its peer failed (a raise the
    abort told it of at once) was only aborted: the run failed, it did not hang. One in a
    collective every member had entered was merely in it, and is only aborted too."""
    updated = dict(verdicts)
    for rank, verdict in verdicts.items():
        p, view = verdict.pending, analysis.views.get(rank)
        if verdict.status is not Status.ABORTED or p is None or not p.waiting_for:
            continue
        if view is None or not view.aborts:
            continue
        learned_at, _, abort = view.aborts[0]
        # How long it had waited when the peer failed: how long the abort took to reach it
        # (a few store polls, longer on a loaded host) is no part of the hang.
        if stuck(view, analysis, until=learned_at - abort.learned_after_s):
            updated[rank] = replace(verdict, status=Status.BLOCKED)
    return updated


def killed_together(verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run]) -> bool:
    """Every rank went silent at once without journaling an end: the whole job was killed
    from outside (a pod, an allocation), which says nothing of which rank went wrong."""
    lasts = [v.last_wall for v in analysis.views.values() if v.last_wall is not None]
    return (
        len(lasts) > 1
        and len(lasts) == len(verdicts)
        and not analysis.missing_ranks
        and all(v.status is Status.CRASHED for v in verdicts.values())
        and max(lasts) - min(lasts) <= max(2 * analysis.heartbeat_interval_s, 1.0)
    )


def stuck_when_killed(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run]
) -> dict[int, RankVerdict]:
    """Ranks killed together: each that was stuck in a collective when it died counts as
    blocked there, so the hang that got the job killed is what the verdict explains."""
    updated = dict(verdicts)
    for rank, verdict in verdicts.items():
        view = analysis.views[rank]
        if stuck(view, analysis, until=view.last_wall or analysis.end_wall):
            updated[rank] = replace(verdict, status=Status.BLOCKED)
    return updated
