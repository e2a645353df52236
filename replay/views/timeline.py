"""What `replay show` prints: each rank's timeline and records, or every rank at one moment."""

from __future__ import annotations

import dataclasses
import textwrap
from collections.abc import Sequence

from lifecycle.core.decisions.learnedshapes import paid_once_text
from lifecycle.core.decisions.weightskey import weights_text
from lifecycle.core.format.accounting import (
    StartupAccount,
    account,
    load_text,
    phases_text,
    total_text,
)
from lifecycle.core.format.events import (
    CollectiveFinished,
    CollectiveStarted,
    Event,
    ResidencyApplied,
    ResidencyEvent,
    ResidencyPlanned,
    ResidencyRolledBack,
    ResidencyVerified,
    StoredEvent,
)
from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.phrases import reuse_text, skip_hint
from lifecycle.core.format.records import Role
from lifecycle.core.format.text import clean, format_bytes, pad
from lifecycle.core.format.view import RankView
from replay.load import RunInfo
from replay.verdict.analysis import RunAnalysis
from replay.views.launch import launch_text
from replay.views.rankchecks import GroupChecks, group_checks, rank_check_lines
from replay.views.render import Style, mib, table, when


def format_header(run: RunInfo, style: Style) -> str:
    line = (
        style.bold(f"run {run.run_id}")
        + f"  {when(run.created_at)}  host {clean(run.host)}  ranks {run.world_size}"
        + f"  model {clean(run.model_name)}"
    )
    return line + (f"\ncommand: {clean(run.command)}" if run.command else "")


def missing_line(analysis: RunAnalysis) -> str:
    return "no events from rank " + ", ".join(map(str, analysis.missing_ranks))


def format_rank(
    view: RankView,
    analysis: RunAnalysis,
    style: Style,
    collectives: Sequence[StoredEvent] | None,
    *,
    checks: GroupChecks | None = None,
) -> list[str]:
    """One rank's timeline, then its last collective records (None: not shown); `checks`, the
    group's part of the check of the ranks, found once for every rank shown (else here)."""
    checked = group_checks(analysis.views) if checks is None else checks
    lines = _rank_timeline(view, analysis, style, checked)
    if collectives is None:
        return lines
    count = sum(g.count for g in view.groups)
    if not collectives:
        if count:
            lines.append(f"  collectives: {count} run, none in the journal (ring after ready)")
        return lines
    started = sum(1 for c in collectives if isinstance(c.event, CollectiveStarted))
    lines.append(
        f"  last {len(collectives)} collective records before the end"
        f" ({started} started; {count:,} collectives in all; --all for every event):"
    )
    lines.extend("    " + event_line(stored, analysis) for stored in collectives)
    shown: dict[str, int] = {}
    for stored in collectives:
        if isinstance(stored.event, CollectiveStarted | CollectiveFinished):
            shown[stored.event.group] = max(
                shown.get(stored.event.group, -1), stored.event.group_seq
            )
    beyond = [g for g in view.groups if g.group in shown and g.started > shown[g.group]]
    if beyond:
        lines.append(
            "    then, in its ring and never written (no trouble on this rank): "
            + ", ".join(
                f"{clean(g.group)} to #{g.started} started, #{g.finished} finished" for g in beyond
            )
        )
    return lines


def event_line(stored: StoredEvent, analysis: RunAnalysis) -> str:
    """One event as a line: when, the state after it, its kind, and what it says."""
    event = stored.event
    at = f"+{analysis.at(stored.wall_time):.3f}"
    match event:
        case CollectiveStarted():
            what = f"{started_text(event)} ({clean(event.purpose)}) {event.dtype}"
        case CollectiveFinished():
            what = (
                f"{event.op} #{event.group_seq} of {event.group} in"
                f" {event.duration_s * 1000:.2f} ms"
            )
        case _:
            what = clean(" ".join(f"{k}={v}" for k, v in _scalars(event)))[:160]
    state, kind = pad(clean(stored.state), 12), pad(clean(stored.kind), 20)
    return f"{at:>10} {stored.seq:>7} {state} {kind} {clean(what)}"


def _scalars(event: Event) -> list[tuple[str, object]]:
    """An event's fields that are plain values (what a one-line listing can show)."""
    return [
        (f.name, value)
        for f in dataclasses.fields(event)
        if isinstance(value := getattr(event, f.name), str | int | float | bool)
        and value != ""
        and f.name not in ("traceback", "raw")
    ]


def _rank_timeline(
    view: RankView, analysis: RunAnalysis, style: Style, checks: GroupChecks
) -> list[str]:
    started = view.run_started
    where = f"pid {started.pid}, {clean(started.device)}" if started else "no run_started"
    lines = [style.bold(f"rank {view.rank}") + f"  ({where})  now {clean(view.state)}"]
    rows = _state_rows(view, analysis)
    lines.extend("  " + line for line in table(["at", "state", "for", ""], rows).splitlines())
    lines.extend(startup_lines(account(view)))
    lines.extend(_warmup_lines(view))
    lines.extend(_setup_lines(view, analysis))
    lines.extend(rank_check_lines(view, checks))
    lines.extend(_trouble_lines(view, analysis))
    lines.extend(_caveat_lines(view))
    # Below the styled first line, plain text with journal values in it (states, groups, ops).
    return [lines[0], *map(clean, lines[1:])]


def _state_rows(view: RankView, analysis: RunAnalysis) -> list[list[str]]:
    """The timeline's table: the launch, then each state entered, for how long, and a note."""
    notes: dict[str, list[str]] = {}
    if view.plan is not None:
        reason = view.plan.skip_reason
        probe = next((r for r in view.plan.requests if r.role is Role.PROBE), None)
        hint = skip_hint(reason)
        notes.setdefault("gate-check", []).append(
            f"calibration skipped: {clean(reason)}" + (f" ({hint})" if hint else "")
            if reason
            else f"calibration on, probe {probe.shape}"
            if probe
            else "calibration on"
        )
    rows = []
    launch = launch_phase(view)
    if launch is not None:
        # Signed: a launch on another host may precede the run's start. Rounded first, so
        # that a launch a clock offset's fraction of a millisecond early reads +0.00.
        at = round(analysis.at(launch.launched_at), 2) + 0.0
        rows.append(
            [
                f"{at:+.2f}",
                "launch",
                f"{launch.launch_s:.3f} s",
                clean(
                    launch_text(launch, phased=bool(view.run_started and view.run_started.phases))
                ),
            ]
        )
    for span in view.spans:
        duration = span.duration_s()
        rows.append(
            [
                f"+{analysis.at(span.entered_at):.2f}",
                span.state,
                "..." if duration is None else f"{duration:.3f} s",
                "; ".join(notes.get(span.state, [])),
            ]
        )
    return rows


def _warmup_lines(view: RankView) -> list[str]:
    """Each warmup record: its shape and steps, its time, its memory, and its stages' times."""
    lines = []
    fit = view.plan.probe_fit if view.plan is not None else None
    for record in view.warmup_records:
        stages = ", ".join(f"{s.name} {s.seconds:.2f}" for s in record.stages if s.ran)
        grew = (
            ""
            if record.peak_bytes is None or record.baseline_bytes is None
            else f" (+{mib(record.peak_bytes - record.baseline_bytes)}"
            + (
                f", estimated +{mib(fit.estimated_peak_bytes)}"
                if record.role is Role.PROBE and fit is not None
                else ""
            )
            + ")"
        )
        lines.append(
            f"  warmup {record.role:<7} {record.shape} at"
            f" {record.steps} steps  {record.total_s:.2f} s  peak {mib(record.peak_bytes)}{grew}"
            f" [{clean(record.memory_source or 'unmeasured')}]  {stages}"
        )
    return lines


def _setup_lines(view: RankView, analysis: RunAnalysis) -> list[str]:
    """What the rank set up and let go: residency steps, compiles and staging buffers."""
    lines = []
    for at, state, step in view.residency:
        lines.append(f"  residency +{analysis.at(at):.2f} {state}: {clean(residency_text(step))}")
    for at, state, compiling in view.compiles:
        label = "weights" if weights_text(compiling) is not None else "compile"
        lines.append(f"  {label} +{analysis.at(at):.2f} {state}: {paid_once_text(compiling)}")
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
    return lines


def _trouble_lines(view: RankView, analysis: RunAnalysis) -> list[str]:
    """Faults injected, errors and notes, stalls, and the collective the rank still waits in."""
    lines = []
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
    return lines


def _caveat_lines(view: RankView) -> list[str]:
    """What to bear in mind reading the rank: its clock offset, unreadable events, seq gaps."""
    lines = []
    clock = view.clock if view.rank != 0 else None
    if clock is not None and clock.offset_s == 0.0:
        lines.append(f"  clock rank 0's (host {clean(clock.host)}, one kernel): no offset")
    elif clock is not None:
        lines.append(
            f"  clock {clock.offset_s:+.4f} s against rank 0's (host {clean(clock.host)},"
            f" measured within {clock.round_trip_s * 1000:.2f} ms); its times are on rank 0's"
        )
    if view.unknown:
        lines.append(f"  {len(view.unknown)} event(s) of unknown kind or undecodable payload")
    if view.seq_gaps:
        gaps = ", ".join(f"{g.expected}->{g.found}" for g in view.seq_gaps[:5])
        lines.append(f"  sequence gaps: {gaps}")
    return lines


def startup_lines(kept: StartupAccount | None) -> list[str]:
    """The startup accounted: its time and what no phase holds, its phases, each load."""
    if kept is None:
        return []
    lines = [f"  startup {total_text(kept)}:"]
    lines.extend(
        textwrap.wrap(
            phases_text(kept), width=96, initial_indent="    ", subsequent_indent="    ",
            break_on_hyphens=False,
        )
    )  # fmt: skip
    lines.extend(f"  load {load_text(load)}" for load in kept.loads)
    return lines


def residency_text(step: ResidencyEvent) -> str:
    """One step of the residency planner as a person reads it."""
    plan = step.plan
    match step:
        case ResidencyPlanned():
            fits = "" if plan.fits else " (none fits: the reference residency is kept)"
            return (
                f"planned {plan.plan_id}, peak {format_bytes(plan.predicted_peak_bytes)}"
                f" predicted, budget {format_bytes(plan.budget_bytes)}{fits};"
                f" not reused: {reuse_text(step.reuse)}"
            )
        case ResidencyApplied():
            reused = "" if step.reused_from is None else f" (reused from run {step.reused_from})"
            return f"applied {plan.plan_id}{reused}"
        case ResidencyVerified():
            return (
                f"verified {plan.plan_id}: peak {format_bytes(step.measured_bytes)}"
                f" (predicted {format_bytes(step.predicted_bytes)})"
            )
        case ResidencyRolledBack():
            ranks = ", ".join(map(str, step.ranks))
            return f"rolled back {plan.plan_id} on every rank (failed on {ranks}): {step.reason}"
    return f"{step.kind} {plan.plan_id}"


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
                "-" if pending is None else started_text(pending.started),
                view.action.action if view.action else "-",
            ]
        )
    header = f"run {clean(analysis.run.run_id)} at +{seconds:.2f} s"
    return (
        header + "\n" + table(["rank", "state", "in state", "pending collective", "action"], rows)
    )


def started_text(started: CollectiveStarted) -> str:
    return f"{started.op} #{started.group_seq} of {started.group}"
