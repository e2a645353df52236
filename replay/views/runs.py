"""What `replay runs` prints: one summary per run, as a table for people and JSON for
machines (pure)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.decisions.deadlines import RankDurations, StartupPath, key_parts
from lifecycle.core.format.view import RankView
from lifecycle.store.summaries import Summary
from replay.load import RunInfo
from replay.verdict.diagnose import Diagnosis, Outcome
from replay.views.render import Style, table, when


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


def run_path(journaled: str | None, *, calibrated: bool, planned: bool) -> str:
    """A run's path, in the word `replay history` heads its key with: the path its ranks
    decided at gate-check and journaled with their expectations (calibrated, reused or
    bounded: a StartupPath). A run that journaled none (it ended before, or a lifecycle before
    the history wrote it) is calibrated where a rank calibrated, else bounded where a rank
    built its plan, else `-`."""
    if journaled is not None:
        return journaled
    if calibrated:
        return StartupPath.CALIBRATED.value
    return StartupPath.BOUNDED.value if planned else "-"


def journaled_paths(rows: Iterable[RankDurations]) -> dict[str, str]:
    """Each run's path as its startup history names it (its lowest rank's key): what a run
    every rank of which ended healthy journaled with its expectations."""
    paths: dict[str, tuple[int, str]] = {}
    for row in rows:
        held = paths.get(row.run_id)
        if held is None or row.rank < held[0]:
            paths[row.run_id] = (row.rank, key_parts(row.key)[1])
    return {run_id: path for run_id, (_, path) in paths.items()}


def views_path(views: Mapping[int, RankView]) -> str:
    """A run's path (run_path) from its ranks' views: the path its lowest rank journaled."""
    ranks = [views[rank] for rank in sorted(views)]
    plans = [v.plan for v in ranks if v.plan is not None]
    expected = (v.expectations for v in ranks if v.expectations is not None)
    return run_path(
        next((key_parts(e.key)[1] for e in expected), None),
        calibrated=any(v.calibrated for v in ranks) or any(p.skip_reason is None for p in plans),
        planned=bool(plans),
    )


def summarize_run(run: RunInfo, diagnosis: Diagnosis) -> RunSummary:
    mode = _mode(run)
    views = diagnosis.analysis.views.values()
    path = views_path(diagnosis.analysis.views)
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


def summarize_settled(
    run: RunInfo, ranks: Sequence[Summary], *, journaled: str | None
) -> RunSummary:
    """What summarize_run says of a run every rank of which ended healthy, from its ranks'
    summary rows and the path its startup history names (`journaled`, from journaled_paths)
    alone (a test holds the two to each other)."""
    planned = [s for s in ranks if s.planned]
    path = run_path(
        journaled,
        calibrated=any(s.calibrated for s in ranks) or any(s.skip_reason is None for s in planned),
        planned=bool(planned),
    )
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
