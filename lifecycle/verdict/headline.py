"""The culprits of a verdict as the launcher and the server name them: each rank `replay
diagnose` names, how it went wrong and where, and the peers that waited on it (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lifecycle.verdict.diagnose import Diagnosis
from lifecycle.verdict.evidence import AbortedBy, Blocked, FirstError, LateArrival
from lifecycle.verdict.outcome import LOSS_ANNOUNCERS, Outcome
from lifecycle.verdict.status import PendingInfo, Status


class Wrong(StrEnum):
    """How a culprit went wrong, as its verdict tells."""

    FAILED = "failed"  # it journaled an error of its own
    HUNG = "hung"  # it made no progress while its peers waited for it
    CRASHED = "crashed"  # its process ended without journaling why
    LATE = "late"  # it came to a collective after a peer had given up waiting there
    OUT_OF_STEP = "out-of-step"  # it went on to a later collective than its peers waited in
    LOST = "lost"  # its group took it for lost; its own journal holds no failure
    ABSENT = "absent"  # it left no journal


@dataclass(frozen=True, slots=True, kw_only=True)
class Culprit:
    rank: int
    wrong: Wrong
    state: str | None  # where it went wrong; None when it left no journal
    error: FirstError | None  # its own first fatal error
    waited_on_by: tuple[Blocked, ...]  # its peers' waits for it
    waiting_in: PendingInfo | None = None  # the collective it is still in, when it is in one


def named_culprits(d: Diagnosis[Any]) -> tuple[Culprit, ...]:
    """Each culprit rank of the verdict, in its order, and how it went wrong."""
    return tuple(_culprit(d, rank) for rank in d.culprit_ranks)


def _culprit(d: Diagnosis[Any], rank: int) -> Culprit:
    verdict = d.verdict_of(rank)
    waits = tuple(e for e in d.evidence if isinstance(e, Blocked) and rank in e.waiting_for)
    if verdict is None:
        return Culprit(rank=rank, wrong=Wrong.ABSENT, state=None, error=None, waited_on_by=waits)
    error = verdict.first_error
    late = any(isinstance(e, LateArrival) and e.rank == rank for e in d.evidence)
    lost = any(
        isinstance(e, AbortedBy) and e.failed_rank == rank and e.announced_by in LOSS_ANNOUNCERS
        for e in d.evidence
    )
    # In the order `replay diagnose` tells a culprit's story in.
    if late and d.outcome is Outcome.HUNG:
        wrong = Wrong.LATE
    elif error is not None:
        wrong = Wrong.FAILED
    elif verdict.status is Status.CRASHED:
        wrong = Wrong.CRASHED
    elif verdict.status is Status.HUNG:
        wrong = Wrong.HUNG
    elif verdict.pending is not None:
        # Waiting in a collective: out of step when its peers are not in it; in the one they
        # gave up in, it hung there (frozen or too slow).
        wrong = Wrong.OUT_OF_STEP if out_of_step(d, verdict.pending) else Wrong.HUNG
    elif lost:
        wrong = Wrong.LOST
    else:
        # Alive and in no collective while its peers waited for it: it hung, though its
        # journal (a serving rank's, whose heartbeats keep to its summary row) says ready.
        wrong = Wrong.HUNG if d.outcome is Outcome.HUNG else Wrong.FAILED
    state = error.state if error is not None else verdict.last_state
    return Culprit(
        rank=rank,
        wrong=wrong,
        state=state,
        error=error,
        waited_on_by=waits,
        waiting_in=verdict.pending,
    )


def out_of_step(d: Diagnosis[Any], pending: PendingInfo) -> bool:
    """Waiting in a collective its peers are not in: one at a sequence number where the
    members disagree, or later than a peer's own wait in that group."""
    if any(m.group == pending.group and m.group_seq == pending.group_seq for m in d.mismatches):
        return True
    return any(
        v.pending is not None
        and v.pending.group == pending.group
        and v.pending.group_seq < pending.group_seq
        for v in d.ranks
    )


_SAID = {
    Wrong.FAILED: "failed in",
    Wrong.HUNG: "hung in",
    Wrong.CRASHED: "crashed in",
    Wrong.LATE: "came late to a collective in",
    Wrong.OUT_OF_STEP: "went out of step with its peers in",
    Wrong.LOST: "was taken for lost in",
}


def culprit_text(culprit: Culprit) -> str:
    """`rank 2 hung in drop-buffers`: who went wrong, how and where."""
    if culprit.wrong is Wrong.ABSENT or culprit.state is None:
        return f"rank {culprit.rank} left no journal"
    return f"rank {culprit.rank} {_SAID[culprit.wrong]} {culprit.state}"
