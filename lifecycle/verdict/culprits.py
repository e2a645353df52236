"""Which rank went wrong first when ranks hung: followed through who waits for whom (pure)."""

from __future__ import annotations

from lifecycle.core.errors import ErrorKind
from lifecycle.verdict.analysis import Mismatch, Run, RunAnalysis
from lifecycle.verdict.evidence import LateArrival
from lifecycle.verdict.status import RankVerdict, Status, blocked


def wait_roots(verdicts: dict[int, RankVerdict], missing: tuple[int, ...]) -> list[int]:
    """Follow 'waits for' from every blocked rank to the ranks that are not blocked."""
    roots: list[int] = []
    seen: set[int] = set()
    frontier = [r for r, v in verdicts.items() if blocked(v)]
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
        if not blocked(verdict):
            failed = verdict.aborted_by if verdict.aborted else None
            by = verdicts.get(failed) if failed is not None and failed != rank else None
            if failed is not None and by is not None and not blocked(by):
                # Stopped by the agreed abort before it reached the collective, for a failure
                # of the named rank's own (not a wait): another victim of that failure, not
                # why the waiter waited. (Aborted by a rank whose wait broke, it stays the
                # root: it is what that rank waited for.)
                frontier.append(failed)
            elif rank not in roots:
                roots.append(rank)
            continue
        assert verdict.pending is not None
        frontier.extend(verdict.pending.waiting_for)
    return roots


def late_arrivals(
    verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run]
) -> dict[int, LateArrival]:
    """Members that entered a collective only after a peer's wait there had timed out."""
    late: dict[int, LateArrival] = {}
    for verdict in verdicts.values():
        p, e = verdict.pending, verdict.first_error
        if p is None or e is None or e.kind is not ErrorKind.COLLECTIVE_TIMEOUT:
            continue
        evidence = analysis.groups.get(p.group)
        if evidence is None:
            continue
        for member in evidence.members:
            entered = evidence.started_at(member, p.group_seq)
            if member == verdict.rank or entered is None:
                continue
            if analysis.at(entered) > e.at_s and member not in late:
                late[member] = LateArrival(
                    rank=member,
                    group=p.group,
                    group_seq=p.group_seq,
                    entered_s=analysis.at(entered),
                    peer=verdict.rank,
                    peer_gave_up_s=e.at_s,
                )
    return late


def hang_culprits(verdicts: dict[int, RankVerdict], analysis: RunAnalysis[Run]) -> list[int]:
    roots = wait_roots(verdicts, analysis.missing_ranks)
    if roots:
        return sorted(roots, key=lambda r: _when_wrong(verdicts.get(r), analysis))
    # Nobody missing, yet a member timed out: a peer came to that collective too late (after
    # the timeout), and is the one that went wrong first.
    late = late_arrivals(verdicts, analysis)
    if late:
        return sorted(late, key=lambda r: late[r].entered_s)
    # Everyone waits on someone who waits too: a cycle, or members stuck in different
    # collectives at the same sequence number. A rank with a fault injected says so itself;
    # else a minority signature at a mismatched sequence number; else the rank that went past
    # the point where the others are stuck (its pending collective started last) skipped or
    # reordered a collective.
    faulted = [r for r, v in verdicts.items() if v.faults and _in_the_wait(v)]
    if faulted:
        return sorted(faulted)
    odd = _mismatch_minorities(analysis.mismatches)
    if odd:
        return sorted(odd)
    waiting = [v for v in verdicts.values() if blocked(v) and v.pending is not None]
    if waiting:
        latest = max(waiting, key=lambda v: v.pending.since_s if v.pending else 0.0)
        return [latest.rank]
    return [r for r, v in verdicts.items() if v.status is Status.HUNG]


def _in_the_wait(verdict: RankVerdict) -> bool:
    """Blocked in a collective, or stopped by the agreed abort while in one (a peer's timeout
    there, the failure it was aborted by, ended the wait first)."""
    aborted_in_one = verdict.status is Status.ABORTED and verdict.pending is not None
    return blocked(verdict) or aborted_in_one


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


def _when_wrong(verdict: RankVerdict | None, analysis: RunAnalysis[Run]) -> float:
    if verdict is None:
        return float("inf")
    if verdict.first_error is not None:
        return verdict.first_error.at_s
    return analysis.at(analysis.last_progress.get(verdict.rank, analysis.end_wall))
