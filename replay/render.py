"""What replay prints of runs and verdicts: `format_*` for people, `*_json` for machines (pure)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from lifecycle.core.text import clean, display_width
from lifecycle.store.summaries import Summary
from replay.diagnose import Diagnosis, Outcome
from replay.evidence import Evidence, FirstError
from replay.load import RunInfo
from replay.status import PendingInfo, RankVerdict
from replay.summary import mismatch_reason, purpose_text, rank_note, signature_text, summary


@dataclass(frozen=True, slots=True)
class Cell:
    """A table cell as printed (`shown`, which may carry styling) and as measured (`text`)."""

    text: str
    shown: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Style:
    color: bool = False

    def paint(self, text: object, code: str) -> str:
        """`text` cleaned of what a journal could smuggle in, then styled: our own escape
        sequences are the only ones printed."""
        value = clean(text)
        return f"\x1b[{code}m{value}\x1b[0m" if self.color else value

    def cell(self, text: object, code: str) -> Cell:
        return Cell(text=clean(text), shown=self.paint(text, code))

    def outcome_cell(self, outcome: Outcome | str) -> Cell:
        codes = {"ready": "32", "failed": "31", "hung": "33", "crashed": "31;1"}
        return self.cell(outcome, codes.get(str(outcome), "36"))

    def outcome(self, outcome: Outcome | str) -> str:
        return self.outcome_cell(outcome).shown

    def bold(self, text: object) -> str:
        return self.paint(text, "1")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns aligned by display width; each cell is cleaned of control characters unless it is
    a `Cell`, whose text a `Style` already cleaned before styling it."""
    cells = [[_as_cell(c) for c in row] for row in (headers, *rows)]
    widths = [max(display_width(row[i].text) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(
            c.shown + " " * (w - display_width(c.text)) for c, w in zip(row, widths, strict=True)
        ).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths).rstrip())
    return "\n".join(lines)


def _as_cell(value: object) -> Cell:
    if isinstance(value, Cell):
        return value
    text = clean(value)
    return Cell(text=text, shown=text)


def mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f} MiB"


def when(wall: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(wall)) + "Z"
    except (OverflowError, ValueError, OSError):
        return f"? (recorded time {wall!r})"


# -- runs ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSummary:
    run_id: str
    started: float
    host: str
    world_size: int
    mode: str
    path: str
    skip_reason: str | None
    outcome: str
    startup_to_ready_s: float | None
    command: str | None


def summarize_run(run: RunInfo, diagnosis: Diagnosis) -> RunSummary:
    mode = _mode(run)
    views = diagnosis.analysis.views.values()
    plans = [v.plan for v in views if v.plan is not None]
    if any(v.calibrated for v in views) or any(p.skip_reason is None for p in plans):
        path = "calibrated"
    elif plans:
        path = "bounded"
    else:
        path = "-"
    reasons = {v.skip_reason for v in views if v.plan is not None}
    return RunSummary(
        run_id=run.run_id,
        started=run.created_at,
        host=_hosts(run, [v.run_started.host if v.run_started else None for v in views]),
        world_size=run.world_size,
        mode=mode,
        path=path,
        skip_reason=next(iter(reasons)) if len(reasons) == 1 else None,
        outcome=diagnosis.outcome.value,
        startup_to_ready_s=diagnosis.startup_to_ready_s,
        command=run.command,
    )


def summarize_settled(run: RunInfo, ranks: Sequence[Summary]) -> RunSummary:
    """What summarize_run says of a run every rank of which ended healthy, from its ranks'
    summary rows alone (a test holds the two to each other)."""
    planned = [s for s in ranks if s.planned]
    if any(s.calibrated for s in ranks) or any(s.skip_reason is None for s in planned):
        path = "calibrated"
    else:
        path = "bounded" if planned else "-"
    reasons = {s.skip_reason for s in planned}
    ready = [s.ready_at for s in ranks if s.ready_at is not None]
    return RunSummary(
        run_id=run.run_id,
        started=run.created_at,
        host=_hosts(run, [s.host for s in ranks]),
        world_size=run.world_size,
        mode=_mode(run),
        path=path,
        skip_reason=next(iter(reasons)) if len(reasons) == 1 else None,
        outcome=Outcome.READY.value,
        startup_to_ready_s=max(ready) - run.created_at if len(ready) == run.world_size else None,
        command=run.command,
    )


def _hosts(run: RunInfo, hosts: Sequence[str | None]) -> str:
    """The hosts a run's ranks ran on, as their run_started events name them, else the run
    row's; several are listed, rank 0's first."""
    named = list(dict.fromkeys(h for h in hosts if h))
    return ",".join(named) if named else run.host


def _mode(run: RunInfo) -> str:
    mode = str(run.config.get("performance_mode", "?"))
    return mode + " +calibrate" if run.config.get("calibrate") else mode


def format_runs(summaries: Sequence[RunSummary], style: Style) -> str:
    rows = [
        [
            s.run_id,
            when(s.started),
            s.host,
            s.world_size,
            s.mode,
            s.path,
            s.skip_reason or "-",
            style.outcome_cell(s.outcome),
            "-" if s.startup_to_ready_s is None else f"{s.startup_to_ready_s:.2f}",
        ]
        for s in summaries
    ]
    headers = ["run", "started", "host", "ranks", "mode", "path"]
    return table([*headers, "skip reason", "outcome", "ready s"], rows)


def runs_json(summaries: Sequence[RunSummary]) -> list[dict[str, Any]]:
    return [
        {
            "run_id": s.run_id,
            "started_at": s.started,
            "host": s.host,
            "world_size": s.world_size,
            "mode": s.mode,
            "path": s.path,
            "skip_reason": s.skip_reason,
            "outcome": s.outcome,
            "startup_to_ready_s": s.startup_to_ready_s,
            "command": s.command,
        }
        for s in summaries
    ]


# -- diagnose -----------------------------------------------------------------------------------


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
        out.append(
            f"first error: rank {e.rank} in {clean(e.state)} at +{e.at_s:.2f} s:"
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
    if d.missing_ranks:
        out.append("")
        out.append("absent: no events from rank " + ", ".join(map(str, d.missing_ranks)))
    return "\n".join(out)


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
