"""What `replay diagnose` prints: the verdict as text for people and JSON for machines
(pure)."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any

from lifecycle.core.format.text import clean
from lifecycle.verdict.evidence import (
    EnvironmentDiffers,
    Evidence,
    FirstError,
    SlowAtGate,
    Straggling,
)
from lifecycle.verdict.status import PendingInfo, RankVerdict
from replay.verdict.diagnose import Diagnosis
from replay.verdict.rankchecks import evidence_note
from replay.verdict.summary import mismatch_reason, purpose_text, rank_note, signature_text, summary
from replay.views.render import Style, table


def format_diagnosis(d: Diagnosis, style: Style) -> str:
    out = [f"run {clean(d.run_id)}: {style.outcome(d.outcome)}"]
    if d.culprit_ranks:
        out.append(
            style.bold(
                "culprit: rank "
                + ", ".join(map(str, d.culprit_ranks))
                + (f" in {d.culprit_state}" if d.culprit_state else "")
            )
        )
    if d.first_error is not None:
        e = d.first_error
        # A victim's error comes first when the culprit journaled none (it hung, or died),
        # or journaled it later: said, so that it is not read as the cause.
        victim = (
            f", a victim of rank {', '.join(map(str, d.culprit_ranks))}"
            if d.first_error_by_a_victim and d.culprit_ranks
            else ""
        )
        out.append(
            f"first error: rank {e.rank} in {clean(e.state)} at +{e.at_s:.2f} s{victim}:"
            f" {clean(e.error_type)}: {clean(e.message)}"
        )
    out.append("")
    out.append(clean(summary(d)))
    out.append("")
    rows = [
        [
            v.rank,
            clean(_states(v)),
            style.outcome_cell(v.status),
            _pending_text(v.pending),
            "-" if v.last_heartbeat_age_s is None else f"{v.last_heartbeat_age_s:.1f} s",
            clean(v.first_error.error_type) if v.first_error else "-",
        ]
        for v in d.ranks
    ]
    out.append(
        table(["rank", "state", "status", "pending collective", "heartbeat age", "error"], rows)
    )
    out.extend(_rank_check_lines(d))
    out.extend(_collective_lines(d))
    out.extend(_stall_lines(d))
    if d.missing_ranks:
        out.append("")
        out.append("absent: no events from rank " + ", ".join(map(str, d.missing_ranks)))
    return "\n".join(out)


def _rank_check_lines(d: Diagnosis) -> list[str]:
    """What gate-check's check of the ranks found of each rank, and the straggler while
    serving, one line each."""
    found = [
        item
        for item in d.evidence
        if isinstance(item, EnvironmentDiffers | SlowAtGate | Straggling)
    ]
    if not found:
        return []
    return [
        "",
        "checks of the ranks:",
        *(f"  rank {item.rank}: {clean(evidence_note(item, d.analysis.views))}" for item in found),
    ]


def _collective_lines(d: Diagnosis) -> list[str]:
    """Each group's progress per member, then each mismatch with every rank's signature."""
    out = []
    if d.groups:
        out.append("")
        out.append("collectives (highest sequence number started / finished per member):")
        rows = []
        for g in d.groups:
            progress = "  ".join(
                f"r{rank} {g.started_by(rank)}/{g.finished_by(rank)}" for rank in g.members
            )
            rows.append([g.group, ",".join(map(str, g.members)), progress])
        out.append(table(["group", "members", "progress"], rows))
    for m in d.mismatches:
        out.append(f"mismatch {clean(m.group)} #{m.group_seq}: {clean(mismatch_reason(m))}")
        out.extend(f"  rank {rank}: {clean(signature_text(sig))}" for rank, sig in m.by_rank)
    return out


def _stall_lines(d: Diagnosis) -> list[str]:
    """Each stall a rank journaled, with the end of its main thread's stack."""
    out = []
    for view in d.analysis.views.values():
        for at, state, stall in view.stalls:
            out.append("")
            out.append(
                f"stall: rank {view.rank} in {clean(state)} at +{d.analysis.at(at):.2f} s,"
                f" {stall.in_state_s:.1f} s in state"
            )
            main = [t for t in stall.threads if t.name == "MainThread"] or list(stall.threads[:1])
            for thread in main:
                tail = clean(thread.stack, keep_newlines=True).rstrip().splitlines()[-6:]
                out.extend(f"    {line}" for line in tail)
    return out


def _pending_text(p: PendingInfo | None) -> str:
    return "-" if p is None else f"{p.op} #{p.group_seq} {p.group} ({purpose_text(p)})"


def _error_json(error: FirstError | None) -> dict[str, Any] | None:
    if error is None:
        return None
    return {
        "rank": error.rank,
        "type": error.error_type,
        "kind": error.kind.value,
        "message": error.message,
        "state": error.state,
        "at_s": error.at_s,
    }


def _states(v: RankVerdict) -> str:
    """The state a rank's journal ends in, after the one it was working in when a stop moved
    it on (`ready -> stopped`)."""
    return v.state if v.state == v.last_state else f"{v.last_state} -> {v.state}"


def _verdict_json(d: Diagnosis, v: RankVerdict) -> dict[str, Any]:
    p = v.pending
    return {
        "rank": v.rank,
        "state": v.state,
        "last_state": v.last_state,
        "status": v.status.value,
        "pending_collective": None
        if p is None
        else {
            "group": p.group,
            "group_seq": p.group_seq,
            "op": p.op,
            "purpose": p.purpose,
            "since_s": p.since_s,
            "waited_s": p.waited_s,
            "waiting_for": list(p.waiting_for),
            "from_flight_recorder": p.from_flight_recorder,
        },
        "last_heartbeat_age_s": v.last_heartbeat_age_s,
        "first_error": _error_json(v.first_error),
        "faults": list(v.faults),
        "stalls": v.stalls,
        "stop_signal": v.stop_signal,
        "stop_reason": v.stop_reason,
        "note": rank_note(d, v),
    }


def _plain(value: object) -> object:
    """A fact's field as JSON: enums by value, tuples as lists, records as objects."""
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(x) for x in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def evidence_json(item: Evidence) -> dict[str, Any]:
    """An evidence item as a JSON object: its code, then its fields."""
    fields = {f.name: _plain(getattr(item, f.name)) for f in dataclasses.fields(item)}
    return {"code": item.code.value, **fields}


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    return {
        "run_id": d.run_id,
        "outcome": d.outcome.value,
        "culprit_ranks": list(d.culprit_ranks),
        "culprit_state": d.culprit_state,
        "first_error": _error_json(d.first_error),
        "summary": summary(d),
        "startup_to_ready_s": d.startup_to_ready_s,
        "missing_ranks": list(d.missing_ranks),
        "ranks": [_verdict_json(d, v) for v in d.ranks],
        "evidence": [evidence_json(item) for item in d.evidence],
        "groups": [
            {
                "group": g.group,
                "members": list(g.members),
                "started": {str(r): s for r, s in g.started},
                "finished": {str(r): s for r, s in g.finished},
            }
            for g in d.groups
        ],
        "mismatches": [
            {
                "group": m.group,
                "group_seq": m.group_seq,
                "reason": mismatch_reason(m),
                "code": m.reason.value,
                "by_rank": {str(r): signature_text(sig) for r, sig in m.by_rank},
            }
            for m in d.mismatches
        ],
        "stalls": [
            {
                "rank": v.rank,
                "state": state,
                "at_s": d.analysis.at(at),
                "in_state_s": stall.in_state_s,
                "threads": [{"name": t.name, "stack": t.stack} for t in stall.threads],
            }
            for v in d.analysis.views.values()
            for at, state, stall in v.stalls
        ],
    }
