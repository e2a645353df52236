"""What `replay show --json` prints: each rank's timeline and records as data."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from lifecycle.core.decisions.learnedshapes import paid_once_text
from lifecycle.core.format.accounting import (
    account,
    account_json,
)
from lifecycle.core.format.events import (
    StoredEvent,
)
from lifecycle.core.format.launchphase import LaunchPhase, launch_phase
from lifecycle.core.format.view import RankView
from replay.verdict.analysis import RunAnalysis
from replay.views.rankchecks import GroupChecks, group_checks, hosts_json, rank_checks_json
from replay.views.timeline import residency_text


def _launch_json(launch: LaunchPhase | None, analysis: RunAnalysis) -> dict[str, Any] | None:
    if launch is None:
        return None
    return {
        "at_s": analysis.at(launch.launched_at),
        "launch_s": launch.launch_s,
        "process_started_s": launch.spawn_s,
        "imports_s": launch.imports_s,
    }


def show_json(
    analysis: RunAnalysis,
    *,
    ranks: Sequence[int] | None,
    at: float | None,
    collectives: Mapping[int, Sequence[StoredEvent]],
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "run_id": analysis.run.run_id,
        "hosts": hosts_json(analysis.views, ranks),
        "ranks": [],
    }
    if at is not None:
        out["at_s"] = at
    checks = group_checks(analysis.views)
    for rank, view in analysis.views.items():
        if ranks is not None and rank not in ranks:
            continue
        out["ranks"].append(_rank_json(rank, view, analysis, collectives.get(rank, ()), checks))
    return out


def _rank_json(
    rank: int,
    view: RankView,
    analysis: RunAnalysis,
    last: Sequence[StoredEvent],
    checks: GroupChecks,
) -> dict[str, Any]:
    """One rank in `replay show --json`, with its last collective records."""
    return {
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
        "launch": _launch_json(launch_phase(view), analysis),
        "startup": None if (kept := account(view)) is None else account_json(kept),
        "skip_reason": view.skip_reason,
        "warmup_records": _warmup_json(view),
        "residency": _residency_json(view, analysis),
        "compile": _compile_json(view, analysis),
        "buffer_drops": [
            {"state": s, "at_s": analysis.at(t), "bytes_freed": d.bytes_freed}
            for t, s, d in view.buffer_drops
        ],
        "buffer_allocations": [
            {"state": s, "at_s": analysis.at(t), "key": a.key, "bytes": a.bytes}
            for t, s, a in view.buffer_allocations
        ],
        "rank_checks": rank_checks_json(view, checks),
        "errors": _errors_json(view, analysis),
        "pending_collective": _pending_json(view),
        "last_collectives": _collectives_json(last, analysis),
    }


def _warmup_json(view: RankView) -> list[dict[str, Any]]:
    return [
        {
            "role": r.role,
            "shape": str(r.shape),
            "steps": r.steps,
            "total_s": r.total_s,
            "peak_bytes": r.peak_bytes,
            "baseline_bytes": r.baseline_bytes,
            "memory_source": r.memory_source,
        }
        for r in view.warmup_records
    ]


def _residency_json(view: RankView, analysis: RunAnalysis) -> list[dict[str, Any]]:
    return [
        {
            "kind": e.kind,
            "state": s,
            "at_s": analysis.at(t),
            "plan": e.plan.plan_id,
            "text": residency_text(e),
        }
        for t, s, e in view.residency
    ]


def _compile_json(view: RankView, analysis: RunAnalysis) -> list[dict[str, Any]]:
    return [
        {
            "kind": e.kind,
            "state": s,
            "at_s": analysis.at(t),
            **dataclasses.asdict(e),
            "text": paid_once_text(e),
        }
        for t, s, e in view.compiles
    ]


def _errors_json(view: RankView, analysis: RunAnalysis) -> list[dict[str, Any]]:
    return [
        {
            "state": s,
            "at_s": analysis.at(t),
            "type": e.error_type,
            "kind": e.error_kind,
            "message": e.message,
            "fatal": e.fatal,
        }
        for t, s, e in view.errors
    ]


def _pending_json(view: RankView) -> dict[str, Any] | None:
    if view.pending is None:
        return None
    return {
        "group": view.pending.started.group,
        "group_seq": view.pending.started.group_seq,
        "op": view.pending.started.op,
        "from_heartbeat": view.pending.from_heartbeat,
    }


def _collectives_json(last: Sequence[StoredEvent], analysis: RunAnalysis) -> list[dict[str, Any]]:
    return [
        {
            "seq": c.seq,
            "at_s": analysis.at(c.wall_time),
            "state": c.state,
            "kind": c.kind,
            "group": getattr(c.event, "group", None),
            "group_seq": getattr(c.event, "group_seq", None),
            "op": getattr(c.event, "op", None),
        }
        for c in last
    ]
