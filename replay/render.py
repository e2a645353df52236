"""What replay prints: pure `format_*` functions for people and `*_json` ones for machines."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.events import CollectiveStarted
from lifecycle.core.fold import RankView
from replay.analysis import RunAnalysis
from replay.diagnose import Diagnosis, ErrorInfo, Outcome, PendingInfo, RankVerdict, Status
from replay.load import RunInfo

# ANSI escape sequences and other control characters a journal must never smuggle into a
# terminal (tab and newline are kept where the caller allows them).
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def clean(text: object, *, keep_newlines: bool = False) -> str:
    """Journal text made safe to print: no escape sequences, no control characters."""
    value = _ESCAPES.sub("", str(text))
    if not keep_newlines:
        value = value.replace("\n", " ").replace("\t", " ")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Style:
    color: bool = False

    def paint(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def outcome(self, outcome: Outcome | str) -> str:
        codes = {"ready": "32", "failed": "31", "hung": "33", "crashed": "31;1"}
        return self.paint(str(outcome), codes.get(str(outcome), "36"))

    def bold(self, text: str) -> str:
        return self.paint(text, "1")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[clean(c) for c in headers], *[[clean(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    config = run.config
    mode = str(config.get("performance_mode", "?"))
    if config.get("calibrate"):
        mode += " +calibrate"
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
        host=run.host,
        world_size=run.world_size,
        mode=mode,
        path=path,
        skip_reason=next(iter(reasons)) if len(reasons) == 1 else None,
        outcome=diagnosis.outcome.value,
        startup_to_ready_s=diagnosis.startup_to_ready_s,
        command=run.command,
    )


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
            style.outcome(s.outcome) if style.color else s.outcome,
            "-" if s.startup_to_ready_s is None else f"{s.startup_to_ready_s:.2f}",
        ]
        for s in summaries
    ]
    headers = [
        "run",
        "started",
        "host",
        "ranks",
        "mode",
        "path",
        "skip reason",
        "outcome",
        "ready s",
    ]
    return table(headers, rows)


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


# -- show ---------------------------------------------------------------------------------------


def format_show(analysis: RunAnalysis, *, ranks: Sequence[int] | None, style: Style) -> str:
    run = analysis.run
    out = [
        style.bold(f"run {run.run_id}")
        + f"  {when(run.created_at)}  host {clean(run.host)}  ranks {run.world_size}"
        + f"  model {clean(run.model_name)}"
    ]
    if run.command:
        out.append(f"command: {clean(run.command)}")
    for rank, view in analysis.views.items():
        if ranks is not None and rank not in ranks:
            continue
        out.append("")
        out.extend(_rank_timeline(view, analysis, style))
    if analysis.missing_ranks and ranks is None:
        out.append("")
        out.append("no events from rank " + ", ".join(map(str, analysis.missing_ranks)))
    return "\n".join(out)


def _rank_timeline(view: RankView, analysis: RunAnalysis, style: Style) -> list[str]:
    started = view.run_started
    where = f"pid {started.pid}, {clean(started.device)}" if started else "no run_started"
    lines = [style.bold(f"rank {view.rank}") + f"  ({where})  now {view.state}"]
    details: dict[str, list[str]] = {}
    if view.plan is not None:
        reason = view.plan.skip_reason
        probe = next((r for r in view.plan.requests if r.role == "probe"), None)
        details.setdefault("gate-check", []).append(
            f"calibration skipped: {clean(reason)}"
            if reason
            else f"calibration on, probe {probe.width}x{probe.height}x{probe.frames}"
            if probe
            else "calibration on"
        )
    rows = []
    for span in view.spans:
        duration = span.duration_s()
        rows.append(
            [
                f"+{analysis.at(span.entered_at):.2f}",
                span.state,
                "..." if duration is None else f"{duration:.3f} s",
                "; ".join(details.get(span.state, [])),
            ]
        )
    lines.extend("  " + line for line in table(["at", "state", "for", ""], rows).splitlines())
    fit = view.plan.probe_fit if view.plan is not None else None
    for record in view.warmup_records:
        stages = ", ".join(f"{s.name} {s.seconds:.2f}" for s in record.stages if s.ran)
        grew = (
            ""
            if record.peak_bytes is None or record.baseline_bytes is None
            else f" (+{mib(record.peak_bytes - record.baseline_bytes)}"
            + (
                f", estimated +{mib(fit.estimated_peak_bytes)}"
                if record.role == "probe" and fit is not None
                else ""
            )
            + ")"
        )
        lines.append(
            f"  warmup {record.role:<7} {record.width}x{record.height}x{record.frames} at"
            f" {record.steps} steps  {record.total_s:.2f} s  peak {mib(record.peak_bytes)}{grew}"
            f" [{clean(record.memory_source or 'unmeasured')}]  {stages}"
        )
    for at, state, drop in view.buffer_drops:
        lines.append(
            f"  buffers dropped {drop.buffers} ({mib(drop.bytes_freed)}) in {state}"
            f" at +{analysis.at(at):.2f}"
        )
    allocations: dict[str, list[float]] = {}
    for _, state, alloc in view.buffer_allocations:
        allocations.setdefault(state, []).append(alloc.bytes)
    for state, sizes in allocations.items():
        lines.append(f"  buffers allocated {len(sizes)} ({mib(int(sum(sizes)))}) in {state}")
    for at, state, fault in view.faults:
        lines.append(f"  fault  +{analysis.at(at):.2f} {state}: {clean(fault.fault)}")
    for at, state, error in view.errors:
        kind = "error" if error.fatal else "note "
        lines.append(
            f"  {kind}  +{analysis.at(at):.2f} {state}: {clean(error.error_type)}:"
            f" {clean(error.message)}"
        )
    for at, state, stall in view.stalls:
        lines.append(
            f"  stall  +{analysis.at(at):.2f} {state}: {stall.in_state_s:.1f} s in state"
            f" (deadline {stall.deadline_s:g} s), {len(stall.threads)} thread stacks"
        )
    if view.pending is not None:
        p = view.pending.started
        lines.append(
            f"  pending {p.op} #{p.group_seq} of {p.group} ({p.purpose})"
            f" since +{analysis.at(view.pending.at):.2f}"
        )
    if view.unknown:
        lines.append(f"  {len(view.unknown)} event(s) of unknown kind or undecodable payload")
    if view.seq_gaps:
        gaps = ", ".join(f"{g.expected}->{g.found}" for g in view.seq_gaps[:5])
        lines.append(f"  sequence gaps: {gaps}")
    return lines


def format_at(analysis: RunAnalysis, *, seconds: float) -> str:
    wall = analysis.run.created_at + seconds
    rows = []
    for rank, view in analysis.views.items():
        pending = view.pending
        rows.append(
            [
                rank,
                view.state,
                f"{view.time_in_state_s(now=wall) or 0.0:.2f} s",
                "-" if pending is None else _started_text(pending.started),
                view.action.action if view.action else "-",
            ]
        )
    header = f"run {analysis.run.run_id} at +{seconds:.2f} s"
    return (
        header + "\n" + table(["rank", "state", "in state", "pending collective", "action"], rows)
    )


def _started_text(started: CollectiveStarted) -> str:
    return f"{started.op} #{started.group_seq} of {started.group}"


def show_json(
    analysis: RunAnalysis, *, ranks: Sequence[int] | None, at: float | None
) -> dict[str, Any]:
    out: dict[str, Any] = {"run_id": analysis.run.run_id, "ranks": []}
    if at is not None:
        out["at_s"] = at
    for rank, view in analysis.views.items():
        if ranks is not None and rank not in ranks:
            continue
        out["ranks"].append(
            {
                "rank": rank,
                "state": view.state,
                "path": list(view.path),
                "spans": [
                    {
                        "state": s.state,
                        "at_s": analysis.at(s.entered_at),
                        "duration_s": s.duration_s(),
                    }
                    for s in view.spans
                ],
                "skip_reason": view.skip_reason,
                "warmup_records": [
                    {
                        "role": r.role,
                        "shape": f"{r.width}x{r.height}x{r.frames}",
                        "steps": r.steps,
                        "total_s": r.total_s,
                        "peak_bytes": r.peak_bytes,
                        "baseline_bytes": r.baseline_bytes,
                        "memory_source": r.memory_source,
                    }
                    for r in view.warmup_records
                ],
                "buffer_drops": [
                    {"state": s, "at_s": analysis.at(t), "bytes_freed": d.bytes_freed}
                    for t, s, d in view.buffer_drops
                ],
                "buffer_allocations": [
                    {"state": s, "at_s": analysis.at(t), "key": a.key, "bytes": a.bytes}
                    for t, s, a in view.buffer_allocations
                ],
                "errors": [
                    {
                        "state": s,
                        "at_s": analysis.at(t),
                        "type": e.error_type,
                        "message": e.message,
                        "fatal": e.fatal,
                    }
                    for t, s, e in view.errors
                ],
                "pending_collective": None
                if view.pending is None
                else {
                    "group": view.pending.started.group,
                    "group_seq": view.pending.started.group_seq,
                    "op": view.pending.started.op,
                },
            }
        )
    return out


# -- diagnose -----------------------------------------------------------------------------------


def format_diagnosis(d: Diagnosis, style: Style) -> str:
    out = [f"run {d.run_id}: {style.outcome(d.outcome)}"]
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
            f"first error: rank {e.rank} in {e.state} at +{e.at_s:.2f} s:"
            f" {clean(e.error_type)}: {clean(e.message)}"
        )
    out.append("")
    out.append(clean(d.summary))
    out.append("")
    rows = [
        [
            v.rank,
            v.last_state,
            style.outcome(v.status) if style.color else v.status.value,
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
        out.append(f"mismatch {m.group} #{m.group_seq}: {clean(m.reason)}")
        out.extend(f"  rank {rank}: {sig.describe()}" for rank, sig in m.by_rank)
    for view in d.analysis.views.values():
        for at, state, stall in view.stalls:
            out.append("")
            out.append(
                f"stall: rank {view.rank} in {state} at +{d.analysis.at(at):.2f} s,"
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


def _pending_text(pending: PendingInfo | None) -> str:
    if pending is None:
        return "-"
    return f"{pending.op} #{pending.group_seq} {pending.group} ({pending.purpose})"


def _error_json(error: ErrorInfo | None) -> dict[str, Any] | None:
    if error is None:
        return None
    return {
        "rank": error.rank,
        "type": error.error_type,
        "message": error.message,
        "state": error.state,
        "at_s": error.at_s,
    }


def _verdict_json(v: RankVerdict) -> dict[str, Any]:
    p = v.pending
    return {
        "rank": v.rank,
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
        },
        "last_heartbeat_age_s": v.last_heartbeat_age_s,
        "first_error": _error_json(v.first_error),
        "faults": list(v.faults),
        "stalls": v.stalls,
        "stop_signal": v.stop_signal,
        "note": v.note,
    }


def diagnosis_json(d: Diagnosis) -> dict[str, Any]:
    return {
        "run_id": d.run_id,
        "outcome": d.outcome.value,
        "culprit_ranks": list(d.culprit_ranks),
        "culprit_state": d.culprit_state,
        "first_error": _error_json(d.first_error),
        "summary": d.summary,
        "startup_to_ready_s": d.startup_to_ready_s,
        "missing_ranks": list(d.missing_ranks),
        "ranks": [_verdict_json(v) for v in d.ranks],
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
                "reason": m.reason,
                "by_rank": {str(r): sig.describe() for r, sig in m.by_rank},
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


def is_failure(status: Status) -> bool:
    return status in (Status.FAILED, Status.CRASHED, Status.HUNG, Status.BLOCKED)
