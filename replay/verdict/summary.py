"""The sentences a person reads about a verdict, made from its facts: the summary paragraph,
each rank's note, and the text of a collective mismatch (pure)."""

from __future__ import annotations

from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.records import Signature
from lifecycle.verdict import evidence as ev
from lifecycle.verdict.analysis import Mismatch, MismatchReason, SplitDisagreement
from lifecycle.verdict.headline import out_of_step
from lifecycle.verdict.outcome import LOSS_ANNOUNCERS, Outcome
from lifecycle.verdict.status import PendingInfo, RankVerdict, Status
from replay.verdict.diagnose import Diagnosis
from replay.verdict.rankchecks import evidence_note

_MISMATCH_REASONS = {
    MismatchReason.OPS: "different ops",
    MismatchReason.TYPES_OR_SHAPES: "different types or shapes",
    MismatchReason.SPLIT_LENGTHS: "split lists of different lengths",
}

# The check of the ranks' findings the summary tells (a thousand ranks on two drivers would
# otherwise fill it); the diagnosis lists every one.
CHECKS_SUMMARIZED = 3


def mismatch_text(reason: MismatchReason, split: SplitDisagreement | None) -> str:
    if split is not None:
        return (
            f"rank {split.sender} sends {split.sends} elements to rank {split.receiver},"
            f" which expects {split.expects}"
        )
    return _MISMATCH_REASONS.get(reason, str(reason))


def mismatch_reason(mismatch: Mismatch) -> str:
    return mismatch_text(mismatch.reason, mismatch.split)


def signature_text(sig: Signature) -> str:
    shapes = " ".join("x".join(map(str, s)) for s in sig.shapes)
    text = f"{sig.op} {sig.dtype} [{shapes}] ({sig.purpose})"
    if sig.input_splits is not None:
        text += f" splits in {list(sig.input_splits)} out {list(sig.output_splits or ())}"
    return text


def purpose_text(p: PendingInfo | ev.Blocked) -> str:
    """What a collective was for: the lifecycle's purpose, or where a pipeline issued one the
    lifecycle did not record."""
    if not p.from_flight_recorder:
        return p.purpose
    return "not recorded by the lifecycle" + (f", called from {p.caller}" if p.caller else "")


def _pending_note(p: PendingInfo) -> str:
    who = (
        "waiting for " + ", ".join(f"rank {m}" for m in p.waiting_for)
        if p.waiting_for
        else "every member entered it"
    )
    seen = f" seen only by the Flight Recorder, in {p.state}" if p.from_flight_recorder else ""
    return (
        f"in {p.op} #{p.group_seq} of {p.group} ({purpose_text(p)}){seen} since"
        f" +{p.since_s:.2f} s, {who}"
    )


def _stop_cause(signal: str | None, reason: str | None) -> str:
    if signal:
        return f"by {signal}"
    return f"({reason})" if reason is not None else "from outside"


def _item_note(item: ev.RankEvidence, d: Diagnosis) -> str | None:
    """The part of a rank's note that `item` makes; None for items told elsewhere."""
    match item:
        case ev.EnvironmentDiffers() | ev.SlowAtGate() | ev.Straggling():
            return evidence_note(item, d.analysis.views)
        case ev.FirstError():
            return f"{item.error_type} in {item.state}: {item.message}"
        case ev.CrashedSilent():
            return f"journal ends at +{item.last_event_s:.2f} s with no heartbeat after"
        case ev.PidDead():
            return f"its process (pid {item.pid}) is gone"
        case ev.CutOff():
            return "its peers finished collectives with it that it never journaled"
        case ev.StoppedBySignal():
            return f"stopped {_stop_cause(item.signal, None)} in {item.state}"
        case ev.ShutDown():
            return f"stopped {_stop_cause(None, item.reason)} in {item.state}"
        case ev.NoProgress():
            return f"no progress in {item.state}, heartbeats go on"
        case ev.ConnectionBroke():
            return f"its connection broke under rank {item.peer}"
        case ev.NeverEntered():
            return (
                f"rank {item.peer} waited for it in {item.group} #{item.group_seq},"
                " which it never entered"
            )
        case ev.BrokenByStop():
            return "its collective broke once the run was being stopped"
        case ev.AbortedBy():
            who = (
                "the rendezvous store went away"
                if item.failed_rank is None
                else f"rank {item.failed_rank} had failed ({item.error_type})"
            )
            return f"aborted in {item.state}: {who}, learned after {item.learned_after_s:.1f} s"
        case ev.EndedAtTimeout():
            return (
                f"its process ended as its collective's {item.timeout_s:g} s timeout ran out"
                " (NCCL's watchdog ends a process then)"
            )
        case _:
            return None


def rank_note(d: Diagnosis, verdict: RankVerdict) -> str:
    """One line on a rank: where it waits, its error, and what the evidence says of it."""
    parts = [] if verdict.pending is None else [_pending_note(verdict.pending)]
    parts.extend(text for item in d.about(verdict.rank) if (text := _item_note(item, d)))
    return "; ".join(parts)


def _stopped_text(verdict: RankVerdict) -> str:
    if verdict.status is Status.READY:
        return f"rank {verdict.rank} ready"
    if verdict.status is Status.STOPPED:
        cause = _stop_cause(verdict.stop_signal, verdict.stop_reason)
        return f"rank {verdict.rank} {cause} in {verdict.last_state}"
    return f"rank {verdict.rank} {verdict.status} in {verdict.last_state}"


def _running_text(verdict: RankVerdict) -> str:
    if verdict.status is not Status.RUNNING:
        return f"rank {verdict.rank} {verdict.status}"
    text = f"rank {verdict.rank} in {verdict.last_state}"
    p = verdict.pending
    if p is not None:
        text += f" ({p.op} #{p.group_seq} of {p.group} for {p.waited_s:.1f} s)"
    return text


def _opening(d: Diagnosis) -> list[str]:
    if d.outcome is Outcome.READY:
        # A run whose ranks journaled their launch began at it; an older one, when its launcher
        # had started Python and imported the lifecycle.
        launched = any(launch_phase(v) is not None for v in d.analysis.views.values())
        since = " from the launch" if launched else ""
        return [f"every rank reached ready in {d.startup_to_ready_s or 0.0:.2f} s{since}"]
    if d.outcome is Outcome.STOPPED:
        return ["stopped from outside before ready: " + ", ".join(map(_stopped_text, d.ranks))]
    if d.outcome is Outcome.RUNNING:
        return ["still starting: " + ", ".join(map(_running_text, d.ranks))]
    if d.outcome is Outcome.INCOMPLETE:
        if not d.ranks:  # no rank journaled anything: the missing ranks say so below
            return ["the journal ends before a verdict"]
        states = ", ".join(f"rank {v.rank} {v.last_state} ({v.status})" for v in d.ranks)
        return [f"the journal ends before a verdict: {states}"]
    return []


def _culprit_text(d: Diagnosis, rank: int, late: dict[int, ev.LateArrival]) -> list[str]:
    verdict = next((v for v in d.ranks if v.rank == rank), None)
    if verdict is None:
        return [f"rank {rank} left no journal"]
    if rank in late:
        lag = late[rank]
        text = (
            f"rank {rank} came late to {lag.group} #{lag.group_seq}: it entered at"
            f" +{lag.entered_s:.2f} s, after rank {lag.peer} had given up waiting there at"
            f" +{lag.peer_gave_up_s:.2f} s"
        )
    elif verdict.first_error is not None:
        e = verdict.first_error
        first = d.first_error is not None and d.first_error.rank == rank
        text = (
            f"rank {rank} failed {'first, ' if first else ''}in {e.state} at"
            f" +{e.at_s:.2f} s: {e.error_type}: {e.message}"
        )
    elif checked := _failed_checks(d, rank):
        text = (
            f"rank {rank} in {verdict.last_state}, named by the check of the ranks: "
            + "; ".join(evidence_note(item, d.analysis.views) for item in checked)
        )
    elif verdict.status is Status.CRASHED:
        text = f"rank {rank} crashed in {verdict.last_state} ({rank_note(d, verdict)})"
    elif verdict.status is Status.HUNG:
        text = f"rank {rank} hung in {verdict.last_state}, heartbeats going on"
    elif (p := verdict.pending) is not None and not out_of_step(d, p):
        text = (
            f"rank {rank} hung inside {p.op} #{p.group_seq} of {p.group} ({p.purpose}) in"
            f" {verdict.last_state}, which its peers entered too"
        )
    elif p is not None:
        text = (
            f"rank {rank} went on to {p.op} #{p.group_seq} of {p.group} ({p.purpose})"
            " while its peers waited for it in an earlier collective"
        )
    elif (named := _aborted_for(d, rank)) is not None:
        text = (
            f"rank {rank} was taken for lost in {verdict.last_state} ({named.error_type},"
            f" announced by the {named.announced_by}); its own journal holds no failure"
        )
    else:
        text = f"rank {rank} in {verdict.last_state}"
    if verdict.faults:
        return [text, f"(fault injected: {', '.join(verdict.faults)})"]
    return [text]


def _failed_checks(d: Diagnosis, rank: int) -> list[ev.EnvironmentDiffers | ev.SlowAtGate]:
    """What gate-check's check of the ranks failed the startup for on `rank`: an environment
    field that matters, a slow figure under --on-slow-rank fail."""
    return [
        item
        for item in d.about(rank)
        if (isinstance(item, ev.EnvironmentDiffers) and item.matters)
        or (isinstance(item, ev.SlowAtGate) and item.action == "fail")
    ]


def _checked_parts(d: Diagnosis) -> list[str]:
    """The check of the ranks' findings on ranks the summary does not name as culprits (a
    warning at gate-check, a straggler while serving), the first CHECKS_SUMMARIZED of them."""
    found = [
        item
        for item in d.evidence
        if isinstance(item, ev.EnvironmentDiffers | ev.SlowAtGate | ev.Straggling)
        and item.rank not in d.culprit_ranks
    ]
    parts = [
        f"rank {item.rank} {evidence_note(item, d.analysis.views)}"
        for item in found[:CHECKS_SUMMARIZED]
    ]
    if len(found) > CHECKS_SUMMARIZED:
        parts.append(f"{len(found) - CHECKS_SUMMARIZED} more findings of the check of the ranks")
    return parts


def _aborted_for(d: Diagnosis, rank: int) -> ev.AbortedBy | None:
    """The first abort of a peer that named `rank` lost (announced by the server or a peer)."""
    return next(
        (
            e
            for e in d.evidence
            if isinstance(e, ev.AbortedBy)
            and e.failed_rank == rank
            and e.announced_by in LOSS_ANNOUNCERS
        ),
        None,
    )


def _blocked_text(item: ev.Blocked, blocked: set[int], error: ev.FirstError | None) -> str:
    waits = (
        "waiting for rank "
        + ", ".join(f"{m} (itself blocked)" if m in blocked else str(m) for m in item.waiting_for)
        if item.waiting_for
        else "every member had entered it"
    )
    if item.ended is ev.WaitEnd.WAITING:
        ended = f"still waiting after {item.waited_s:.1f} s"
    elif item.ended is ev.WaitEnd.TIMED_OUT:
        ended = f"timed out after {item.waited_s:.1f} s"
    elif item.ended is ev.WaitEnd.ABORTED:
        ended = f"aborted after {item.waited_s:.1f} s"
    else:
        cause = f" ({error.error_type})" if error is not None else ""
        ended = f"broke after {item.waited_s:.1f} s{cause}"
    seen = (
        " (seen by its last heartbeat; its record stayed in the ring: the sequence number may"
        " be one behind)"
        if item.from_heartbeat
        else f" in {item.state}, seen only by PyTorch's Flight Recorder"
        if item.from_flight_recorder
        else ""
    )
    return (
        f"rank {item.rank} in {item.op} #{item.group_seq} of {item.group}"
        f" ({purpose_text(item)}){seen},"
        f" {waits}, {ended}"
    )


def summary(d: Diagnosis) -> str:
    """One paragraph a person reads first."""
    parts = _opening(d)
    late = (
        {e.rank: e for e in d.evidence if isinstance(e, ev.LateArrival)}
        if d.outcome is Outcome.HUNG
        else {}
    )
    for rank in d.culprit_ranks:
        parts.extend(_culprit_text(d, rank, late))
    waiting = [e for e in d.evidence if isinstance(e, ev.Blocked)]
    blocked = {e.rank for e in waiting}
    errors = {v.rank: v.first_error for v in d.ranks}
    lines = [
        _blocked_text(e, blocked, errors.get(e.rank))
        for e in waiting
        if e.rank not in d.culprit_ranks
    ]
    if lines:
        parts.append("then blocked: " + "; ".join(lines))
    aborted = [
        e
        for e in d.evidence
        if isinstance(e, ev.AbortedBy) and e.rank not in blocked and e.rank not in d.culprit_ranks
    ]
    if aborted:
        parts.append(
            "then aborted: "
            + ", ".join(f"rank {e.rank} in {e.state}" for e in aborted)
            + f", learned within {max(e.learned_after_s for e in aborted):.1f} s"
        )
    mismatched = [e for e in d.evidence if isinstance(e, ev.Mismatched)]
    if mismatched:
        m = mismatched[0]
        parts.append(f"mismatch at {m.group} #{m.group_seq}: {mismatch_text(m.reason, m.split)}")
    parts.extend(_checked_parts(d))
    if d.missing_ranks:
        parts.append("no journal for rank " + ", ".join(map(str, d.missing_ranks)))
    return f"{d.outcome.value}: " + "; ".join(parts)
