"""How a run ended, from its ranks' verdicts: ready, failed, hung, crashed, stopped, still
running, or not known from the journals at hand; and the ranks that ending names (pure)."""

from __future__ import annotations

from enum import StrEnum

from lifecycle.core.errors import ErrorKind
from lifecycle.verdict.analysis import Run, RunAnalysis
from lifecycle.verdict.culprits import hang_culprits
from lifecycle.verdict.evidence import FirstError
from lifecycle.verdict.rankchecks import rank_check_culprits
from lifecycle.verdict.status import RankVerdict, Status, blocked


class Outcome(StrEnum):
    READY = "ready"
    FAILED = "failed"
    HUNG = "hung"
    CRASHED = "crashed"
    STOPPED = "stopped"  # stopped from outside before ready, with no failure before the stop
    RUNNING = "running"  # still starting: every rank alive and moving
    INCOMPLETE = "incomplete"  # the journals end before a verdict (a rank's journal missing)


# Who announces a rank lost rather than failed: rank 0's server under torchrun (a beat that
# stopped), or a peer (rank 0's broadcasts that stopped).
LOSS_ANNOUNCERS = ("server", "peer")


def run_outcome(
    verdicts: dict[int, RankVerdict],
    analysis: RunAnalysis[Run],
    errors: list[FirstError],
    *,
    killed: bool,
) -> tuple[Outcome, list[int]]:
    """How the run ended, and the ranks it names for it (the culprits, in order)."""
    crashed = [r for r, v in verdicts.items() if v.status is Status.CRASHED]
    failed = [r for r, v in verdicts.items() if v.status is Status.FAILED]
    statuses = {v.status for v in verdicts.values()}
    hung_evidence = any(blocked(v) for v in verdicts.values()) or Status.HUNG in statuses
    complete = bool(verdicts) and not analysis.missing_ranks
    if killed and hung_evidence:
        return Outcome.HUNG, hang_culprits(verdicts, analysis)
    if crashed:
        return Outcome.CRASHED, sorted(crashed, key=lambda r: analysis.views[r].last_wall or 0.0)
    if complete and statuses == {Status.READY}:
        return Outcome.READY, []
    if hung_evidence:
        return Outcome.HUNG, hang_culprits(verdicts, analysis)
    if errors or failed:
        if errors and errors[0].kind is ErrorKind.RANK_CHECK:
            # Every rank fails the check with the same line: the ranks it names, not the
            # first to journal it.
            named = rank_check_culprits(analysis.views)
            if named:
                return Outcome.FAILED, named
        return Outcome.FAILED, [errors[0].rank] if errors else failed[:1]
    # Aborted for a rank whose own journal holds no failure, announced lost by the server or
    # a peer: the group took it for lost (its process stopped, its host cut off), whatever it
    # journaled afterwards.
    lost = [
        v.aborted_by
        for v in verdicts.values()
        if v.aborted
        and v.aborted_by in verdicts
        and analysis.views[v.rank].aborts[0][2].announced_by in LOSS_ANNOUNCERS
    ]
    if lost:
        return Outcome.FAILED, lost[:1]
    if complete and statuses <= {Status.READY, Status.STOPPED}:
        return Outcome.STOPPED, []
    if complete and statuses <= {Status.READY, Status.STOPPED, Status.RUNNING}:
        return Outcome.RUNNING, []
    return Outcome.INCOMPLETE, []
