"""Two runs side by side: times, warmup requests, peak memory, path, and a verdict (pure)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.accounting import account
from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.records import PhaseTime
from lifecycle.core.format.states import State
from replay.verdict.analysis import RunAnalysis
from replay.verdict.diagnose import Diagnosis
from replay.views.runs import views_path


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupLine:
    role: str
    shape: str
    steps: int
    total_s: float
    peak_bytes: int | None
    grew_bytes: int | None  # peak over the baseline before the request


@dataclass(frozen=True, slots=True, kw_only=True)
class RunProfile:
    run_id: str
    model: str  # its name as recorded
    model_digest: str  # of its recorded specification (a directory's file digest included)
    layout: str  # ranks, CFG and Ulysses degrees
    outcome: str
    startup_to_ready_s: float | None  # from the launch (from the run's start before v2)
    launch_s: float | None  # the slowest rank's launch phase: from the launch to `created`
    imports_s: float | None  # the slowest rank's, from its process start to its first event
    state_s: tuple[tuple[str, float], ...]  # the slowest rank's time in each state, in order
    warmup: tuple[WarmupLine, ...]  # rank 0's requests
    warmup_s: float
    peak_by_state: tuple[tuple[str, int], ...]  # highest peak of any rank, per state
    path: tuple[str, ...]
    skip_reason: str | None
    calibrated: bool
    startup_path: str = "-"  # calibrated, reused or bounded, as `replay runs` names it
    # The startup accounted, of the rank that took longest to ready: each phase's seconds
    # (its phases in order), each component's load seconds, and what no phase holds.
    phases: tuple[tuple[str, float], ...] = ()
    loads: tuple[tuple[str, float], ...] = ()
    unattributed_s: float | None = None


def profile(diagnosis: Diagnosis) -> RunProfile:
    analysis: RunAnalysis = diagnosis.analysis
    state_s: dict[str, float] = {}
    peaks: dict[str, int] = {}
    for view in analysis.views.values():
        for span in view.spans:
            duration = span.duration_s()
            if duration is not None and span.state not in (State.READY, State.STOPPED):
                state_s[span.state] = max(state_s.get(span.state, 0.0), duration)
        for record in view.warmup_records:
            phase = {"bounded": "bounded-warm", "probe": "probe", "rewarm": "re-warm"}.get(
                record.role, record.role
            )
            if record.peak_bytes is not None:
                peaks[phase] = max(peaks.get(phase, 0), record.peak_bytes)
    launches = [launch_phase(view) for view in analysis.views.values()]
    known = [launch for launch in launches if launch is not None]
    imports = [launch.imports_s for launch in known if launch.imports_s is not None]
    lead = analysis.views.get(0) or next(iter(analysis.views.values()), None)
    warmup = tuple(
        WarmupLine(
            role=r.role,
            shape=str(r.shape),
            steps=r.steps,
            total_s=r.total_s,
            peak_bytes=r.peak_bytes,
            grew_bytes=None
            if r.peak_bytes is None or r.baseline_bytes is None
            else r.peak_bytes - r.baseline_bytes,
        )
        for r in (lead.warmup_records if lead else ())
    )
    order = [s.value for s in State]
    config = analysis.run.config
    accounts = [a for view in analysis.views.values() if (a := account(view)) is not None]
    slowest = max(accounts, key=lambda a: (a.total_s, -a.rank), default=None)
    return RunProfile(
        run_id=analysis.run.run_id,
        model=analysis.run.model_name,
        model_digest=_digest(config.get("model")),
        layout=_layout(config),
        outcome=diagnosis.outcome.value,
        startup_to_ready_s=diagnosis.startup_to_ready_s,
        launch_s=max((launch.launch_s for launch in known), default=None),
        imports_s=max(imports, default=None),
        state_s=tuple(sorted(state_s.items(), key=lambda kv: order.index(kv[0]))),
        warmup=warmup,
        warmup_s=sum(w.total_s for w in warmup),
        peak_by_state=tuple(sorted(peaks.items(), key=lambda kv: order.index(kv[0]))),
        path=lead.path if lead else (),
        skip_reason=lead.skip_reason if lead else None,
        calibrated=any(v.calibrated for v in analysis.views.values()),
        startup_path=views_path(analysis.views),
        phases=_summed(slowest.phases) if slowest else (),
        loads=tuple(
            (load.component, load.seconds)
            for load in (slowest.loads if slowest else ())
            if load.seconds is not None
        ),
        unattributed_s=slowest.unattributed_s if slowest else None,
    )


def _summed(phases: Sequence[PhaseTime]) -> tuple[tuple[str, float], ...]:
    """Each phase's seconds, a name met twice (an action run twice) summed, in order."""
    spent: dict[str, float] = {}
    for phase in phases:
        spent[phase.name] = spent.get(phase.name, 0.0) + phase.seconds
    return tuple(spent.items())


def largest_change(a: RunProfile, b: RunProfile) -> str | None:
    """The phase or load whose time changed most from A to B, in words."""
    changes = []
    for kind, left, right in (("", a.phases, b.phases), ("load ", a.loads, b.loads)):
        mine, theirs = dict(left), dict(right)
        for name in mine.keys() & theirs.keys():
            changes.append((theirs[name] - mine[name], f"{kind}{name}", mine[name], theirs[name]))
    if not changes:
        return None
    change, name, before, after = max(changes, key=lambda c: abs(c[0]))
    return f"most changed: {name} {before:.2f} s -> {after:.2f} s ({change:+.2f} s)"


def _digest(model: Any) -> str:
    """A digest of a run's recorded model specification: two runs of one model share it."""
    text = json.dumps(model, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _layout(config: dict[str, Any]) -> str:
    def number(key: str) -> str:
        value = config.get(key)
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"

    ranks = number("num_ranks")
    return (
        f"{ranks} rank{'' if ranks == '1' else 's'}"
        f" (cfg {number('cfg_parallel')} x ulysses {number('ulysses')})"
    )


def apart(a: RunProfile, b: RunProfile) -> str | None:
    """What makes the two runs' figures not comparable (another model, another layout)."""
    if a.model != b.model:
        return f"different models: A is {a.model}, B is {b.model}"
    if a.model_digest != b.model_digest:
        return f"different models: {a.model} differs in its specification or files"
    if a.layout != b.layout:
        return f"different layouts: A on {a.layout}, B on {b.layout}"
    return None


def _steps(lines: tuple[WarmupLine, ...]) -> str:
    steps = sorted({w.steps for w in lines})
    return "/".join(map(str, steps)) if steps else "-"


def _requests(lines: tuple[WarmupLine, ...]) -> str:
    count = len(lines)
    return f"{count} warmup request{'s' if count != 1 else ''} at {_steps(lines)} steps"


def verdict(a: RunProfile, b: RunProfile) -> str:
    """One line on what changed from A to B; first, when it is so, that the runs are of
    different models or layouts, which no time compares."""
    parts = []
    differs = apart(a, b)
    if differs is not None:
        parts.append(f"{differs} (their times are not comparable)")
    if a.calibrated != b.calibrated:
        verb = "skips" if a.calibrated else "adds"
        parts.append(
            f"B {verb} the probe: {_requests(a.warmup)} -> {_requests(b.warmup)};"
            f" warmup {a.warmup_s:.1f} s -> {b.warmup_s:.1f} s"
        )
    else:
        path = (
            f"same path ({a.startup_path})"
            if a.startup_path == b.startup_path
            else f"path {a.startup_path} -> {b.startup_path}"
        )
        parts.append(f"{path}; warmup {a.warmup_s:.1f} s -> {b.warmup_s:.1f} s")
    if a.startup_to_ready_s is not None and b.startup_to_ready_s is not None:
        change = (b.startup_to_ready_s - a.startup_to_ready_s) / a.startup_to_ready_s * 100
        parts.append(
            f"startup to ready {a.startup_to_ready_s:.1f} s -> {b.startup_to_ready_s:.1f} s"
            f" ({change:+.0f}%)"
        )
    if a.launch_s is not None and b.launch_s is not None:
        parts.append(f"launch {a.launch_s:.1f} s -> {b.launch_s:.1f} s")
    if (moved := largest_change(a, b)) is not None:
        parts.append(moved)
    if a.skip_reason != b.skip_reason:
        parts.append(f"skip reason {a.skip_reason or 'none'!r} -> {b.skip_reason or 'none'!r}")
    if a.outcome != b.outcome:
        parts.append(f"outcome {a.outcome} -> {b.outcome}")
    return "; ".join(parts)


def format_diff(a: RunProfile, b: RunProfile) -> str:
    from lifecycle.core.format.text import clean
    from replay.views.render import mib, table

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f} s"

    rows: list[list[object]] = [
        ["model", clean(a.model), clean(b.model)],
        ["layout", a.layout, b.layout],
        ["outcome", a.outcome, b.outcome],
        ["path", " > ".join(a.path), " > ".join(b.path)],
        ["skip reason", clean(a.skip_reason or "-"), clean(b.skip_reason or "-")],
        ["startup to ready", seconds(a.startup_to_ready_s), seconds(b.startup_to_ready_s)],
        ["launch", seconds(a.launch_s), seconds(b.launch_s)],
        ["imports", seconds(a.imports_s), seconds(b.imports_s)],
        ["warmup total", seconds(a.warmup_s), seconds(b.warmup_s)],
    ]
    states_a, states_b = dict(a.state_s), dict(b.state_s)
    for state in dict.fromkeys([*states_a, *states_b]):
        rows.append([f"in {state}", seconds(states_a.get(state)), seconds(states_b.get(state))])
    for index in range(max(len(a.warmup), len(b.warmup))):
        cells: list[object] = [f"warmup {index + 1}"]
        for lines in (a.warmup, b.warmup):
            if index < len(lines):
                w = lines[index]
                cells.append(f"{w.role} {w.shape} x{w.steps} {w.total_s:.2f} s")
            else:
                cells.append("-")
        rows.append(cells)
    for kind, left, right in (("phase ", a.phases, b.phases), ("load ", a.loads, b.loads)):
        mine, theirs = dict(left), dict(right)
        for name in dict.fromkeys([*mine, *theirs]):
            rows.append(
                [f"{kind}{clean(name)}", seconds(mine.get(name)), seconds(theirs.get(name))]
            )
    if a.unattributed_s is not None or b.unattributed_s is not None:
        rows.append(["unattributed", seconds(a.unattributed_s), seconds(b.unattributed_s)])
    peaks_a, peaks_b = dict(a.peak_by_state), dict(b.peak_by_state)
    for state in dict.fromkeys([*peaks_a, *peaks_b]):
        rows.append([f"peak in {state}", mib(peaks_a.get(state)), mib(peaks_b.get(state))])
    return table(["", f"A {a.run_id}", f"B {b.run_id}"], rows) + "\n" + verdict(a, b)


def diff_json(a: RunProfile, b: RunProfile) -> dict[str, object]:
    import dataclasses

    return {"a": dataclasses.asdict(a), "b": dataclasses.asdict(b), "verdict": verdict(a, b)}
