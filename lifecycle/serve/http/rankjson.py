"""One rank as /lifecycle shows it: its folded state, its exit, its launch and startup, and
its progress; and what gate-check and the requests' lags say of the ranks."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lifecycle.core.format.accounting import account, account_json
from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from lifecycle.serve.console.progress import eta_s
from lifecycle.serve.console.steps import StepMark
from lifecycle.verdict.evidence import EnvironmentDiffers, SlowAtGate
from lifecycle.verdict.launched import ended_unjournaled, exit_text
from lifecycle.verdict.rankchecks import rank_check_evidence, serving_straggler


def at(codes: list[int | None], index: int) -> int | None:
    return codes[index] if index < len(codes) else None


def rank_json(
    view: RankView, *, now: float, exit_code: int | None, step: StepMark | None = None
) -> dict[str, Any]:
    """One rank's folded state as /lifecycle shows it: `state` is the journal's unless the
    process ended without journaling its end (`exited`; the journal's stays in
    `journaled_state`), and `exit` reads `exit_code` as every other line does. `launch` is
    its launch phase and `startup_to_ready_s` counts from it; `startup` accounts for every
    second of it (to now, while it starts); `step` is how far the request
    it is denoising has got (from `step`, the latest mark the rank wrote: none once its last
    step is made, or from a state it has left), and `eta_s` what history expects it to need
    still before ready."""
    state = "exited" if ended_unjournaled(view, exit_code) else view.state
    launch = launch_phase(view)
    ready_at = view.entered_at(State.READY.value)
    return {
        "rank": view.rank,
        "state": state,
        "journaled_state": view.state,
        "healthy": view.healthy and exit_code is None,
        "time_in_state_s": view.time_in_state_s(now=now),
        "launch": None
        if launch is None
        else {
            "launch_s": launch.launch_s,
            "process_started_s": launch.spawn_s,
            "imports_s": launch.imports_s,
        },
        "startup_to_ready_s": None
        if launch is None or ready_at is None
        else ready_at - launch.launched_at,
        "startup": None if (kept := account(view, now=now)) is None else account_json(kept),
        "step": None
        if step is None or step.state != view.state or step.done >= step.steps
        else {"done": step.done, "steps": step.steps},
        "eta_s": eta_s(view, now=now),
        "path": list(view.path),
        "skip_reason": view.skip_reason,
        "calibrated": view.calibrated,
        "pending_collective": _pending_json(view, now=now),
        "last_heartbeat_age_s": None
        if view.last_heartbeat_wall is None
        else now - view.last_heartbeat_wall,
        "first_error": _first_error_json(view),
        "live_buffer_bytes": view.live_buffer_bytes,
        "requests": view.requests_finished,
        "exit_code": exit_code,
        "exit": None if exit_code is None else exit_text(exit_code),
    }


def _pending_json(view: RankView, *, now: float) -> dict[str, Any] | None:
    """The collective the rank waits in, and for how long by `now`."""
    pending = view.pending
    if pending is None:
        return None
    return {
        "group": pending.started.group,
        "group_seq": pending.started.group_seq,
        "op": pending.started.op,
        "purpose": pending.started.purpose,
        "waiting_s": now - pending.at,
    }


def _first_error_json(view: RankView) -> dict[str, Any] | None:
    if not view.errors:
        return None
    _, state, error = view.errors[0]
    return {"state": state, "type": error.error_type, "message": error.message}


def ranks_json(
    views: dict[int, RankView],
    *,
    codes: list[int | None],
    steps: dict[int, StepMark],
    hosts: dict[int, str],
    lost: dict[int, str],
    now: float,
) -> list[dict[str, Any]]:
    """Every rank as /lifecycle shows it, with its host and whether it was lost."""
    return [
        {
            **rank_json(view, now=now, exit_code=at(codes, r), step=steps.get(r)),
            "host": hosts.get(r),
            "lost": lost.get(r),
            # A rank lost (its host gone, its process stopped) is in no state its journal
            # can say: what it last said stays in journaled_state.
            **({"state": "lost", "healthy": False} if r in lost else {}),
        }
        for r, view in views.items()
    ]


def straggler_json(views: Mapping[int, RankView]) -> dict[str, Any] | None:
    """The rank consistently late entering its requests' collectives, if one is: its group,
    the median of its latest lags over `requests`, the next latest rank's median, and the
    sentence a person reads."""
    late = serving_straggler(views)
    if late is None:
        return None
    return {
        "rank": late.rank,
        "group": late.group,
        "median_lag_s": late.median_lag_s,
        "requests": late.requests,
        "next_lag_s": late.next_lag_s,
        "text": late.describe(),
    }


def rank_checks_json(views: Mapping[int, RankView]) -> list[dict[str, Any]]:
    """What gate-check found of the ranks: each field a rank's environment differs in from
    its group's (`environment`), each figure it measured slow (`slow-rank`); `code` names
    which, the evidence item's fields follow."""
    return [
        {"code": item.code.value, **dataclasses.asdict(item)}
        for item in rank_check_evidence(views)
        if isinstance(item, EnvironmentDiffers | SlowAtGate)
    ]
