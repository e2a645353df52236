"""The residency planner's steps on a rank: find a verified plan to reuse at gate-check, plan
after the probe, apply before the re-warm (or before bounded-warm when reused), verify after
it, and roll back on every rank when any rank's plan fails; each agreed through a recorded
collective and journaled."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from lifecycle import __version__
from lifecycle.core.decisions.agreement import agreed_rollback
from lifecycle.core.decisions.fingerprint import (
    PlanStatus,
    Reuse,
    StoredPlan,
    choose_reuse,
    fingerprint,
)
from lifecycle.core.decisions.residencyplanner import (
    MIB,
    Candidate,
    candidates,
    check_options,
    choose,
    default_budget,
    plan_residency,
    predict,
    reference_choices,
    replan,
    same_plan,
    verify_peak,
    verify_time,
)
from lifecycle.core.errors import JournalError
from lifecycle.core.format import events as ev
from lifecycle.core.format.records import (
    ComponentCost,
    PlannerInput,
    Platform,
    RequestResult,
    ResidencyOption,
    ResidencyPlan,
    ReuseCode,
    ReuseDecision,
    Role,
)
from lifecycle.runtime.pipeline import resident

if TYPE_CHECKING:
    from lifecycle.runtime.rankruntime import RankRuntime


def stored_plans(history: Sequence[ev.StoredEvent]) -> list[StoredPlan]:
    """One plan per run, from its rank 0's residency events (newest first): the newest event of
    a run says how its plan ended. A startup that reused a plan carries it on, verified."""
    plans: dict[str, StoredPlan] = {}
    for stored in history:
        event = stored.event
        if stored.run_id in plans or not isinstance(event, ev.ResidencyEvent):
            continue
        status, note, verified_in = PlanStatus.PLANNED, "", ""
        if isinstance(event, ev.ResidencyVerified):
            status, verified_in = PlanStatus.VERIFIED, stored.run_id
        elif isinstance(event, ev.ResidencyRolledBack):
            status, note = PlanStatus.ROLLED_BACK, event.reason
        elif isinstance(event, ev.ResidencyApplied) and event.reused_from is not None:
            status, verified_in = PlanStatus.VERIFIED, event.reused_from
        plans[stored.run_id] = StoredPlan(
            run_id=stored.run_id,
            fingerprint=event.fingerprint,
            plan=event.plan,
            status=status,
            note=note,
            verified_in=verified_in,
        )
    return list(plans.values())


def budget_for(rt: RankRuntime, platform: Platform) -> int:
    given = rt.args.memory_budget_bytes
    if given is not None:
        return given
    return default_budget(free_bytes=platform.free_bytes, total_bytes=platform.total_bytes)


def find_reuse(rt: RankRuntime, platform: Platform) -> Reuse:
    """The verified plan this startup may reuse, and why (gate-check)."""
    args = rt.args
    rt.fingerprint = fingerprint(
        args,
        device=platform.name,
        total_bytes=platform.total_bytes,
        torch_version=torch.__version__,
        lifecycle=__version__,
    )
    if not args.model.declares_residency:
        no_options = ReuseDecision(code=ReuseCode.NO_OPTIONS.value, model=args.model.name)
        return Reuse(stored=None, decision=no_options)
    try:
        history = rt.recorder.residency_history(args.model.name)
    except JournalError as exc:
        unreadable = ReuseDecision(code=ReuseCode.UNREADABLE.value, note=str(exc))
        return Reuse(stored=None, decision=unreadable)
    reuse = choose_reuse(
        rt.fingerprint, stored_plans(history), budget_bytes=budget_for(rt, platform)
    )
    return reuse if reuse.stored is None else _replanned(rt, reuse.stored, reuse)


def _replanned(rt: RankRuntime, stored: StoredPlan, reuse: Reuse) -> Reuse:
    """`reuse` when the plan is the one its own run's journaled inputs decide, as `replay
    verify` checks it; else calibrate: a plan edited in the journal is never applied on trust.
    With every rank's inputs the agreed plan is decided again; with some missing (a journal
    that holds only some of the ranks), rank 0's plan must be one of its own candidates, with
    the prediction its inputs make."""
    origin = stored.verified_in or stored.run_id
    try:
        planned = rt.recorder.planned_inputs(origin)
    except JournalError as exc:
        unreadable = ReuseDecision(code=ReuseCode.UNREADABLE.value, run_id=origin, note=str(exc))
        return Reuse(stored=None, decision=unreadable)
    given = {s.rank: s.event.given for s in planned if isinstance(s.event, ev.ResidencyPlanned)}
    decided: ResidencyPlan | None = None
    if set(given) == set(range(rt.args.num_ranks)):
        plans = replan([given[rank] for rank in sorted(given)])
        decided = plans[0] if plans is not None else None
    elif 0 in given:
        decided = next(
            (
                plan_residency(given[0], agreed=(index, candidate.fits))
                for index, candidate in enumerate(candidates(given[0]))
                if candidate.choices == stored.plan.choices
            ),
            None,
        )
    if decided is None or not same_plan(stored.plan, decided):
        forged = replace(reuse.decision, code=ReuseCode.NOT_REPLANNED.value)
        return Reuse(stored=None, decision=forged)
    return reuse


def _options(rt: RankRuntime, role: Role) -> tuple[ResidencyOption, ...]:
    requests = rt.plan.by_role(role) if rt.plan is not None else ()
    pipeline = resident(rt.pipeline)
    if not requests or pipeline is None:
        return ()
    return pipeline.residency_options(requests[0].shape)


def _costs(result: RequestResult) -> tuple[ComponentCost, ...]:
    return tuple(
        ComponentCost(component=s.name, seconds=s.seconds, peak_bytes=s.peak_bytes)
        for s in result.stages
        if s.ran and s.peak_bytes is not None
    )


def _agree_candidates(rt: RankRuntime, table: tuple[Candidate, ...]) -> tuple[int, bool]:
    """Every rank's predictions for every combination, gathered: the combination to run."""
    world = rt.comm.world
    local = torch.tensor(
        [[float(c.fits), c.seconds, float(c.peak_bytes)] for c in table], dtype=torch.float64
    )
    everyone = local.repeat(world.size, 1, 1)  # this rank's own, should the gather not run
    world.all_gather(everyone, local, purpose="residency-plan")
    tables = [
        [
            Candidate(choices=c.choices, fits=bool(row[0]), seconds=row[1], peak_bytes=int(row[2]))
            for c, row in zip(table, rank_rows, strict=True)
        ]
        for rank_rows in everyone.tolist()
    ]
    return choose(tables)


def plan_after_probe(rt: RankRuntime) -> None:
    """Plan from the probe's measurement; the ranks agree on one combination (probe)."""
    probe = rt.measured.get(Role.PROBE)
    options = _options(rt, Role.PROBE)
    platform, fp = rt.platform, rt.fingerprint
    if probe is None or not options or platform is None or fp is None:
        return  # --calibrate on a pipeline without options: the probe only measures
    problem = check_options(options)
    if problem is not None or probe.baseline_bytes is None:
        why = ReuseDecision(code=ReuseCode.BAD_OPTIONS.value, note=problem) if problem else None
        rt.reuse = Reuse(stored=None, decision=why or ReuseDecision(code=ReuseCode.NO_MEMORY.value))
        return
    given = PlannerInput(
        baseline_bytes=probe.baseline_bytes,
        costs=_costs(probe),
        options=options,
        total_bytes=platform.total_bytes,
        free_bytes=platform.free_bytes,
        budget_bytes=budget_for(rt, platform),
    )
    plan = plan_residency(given, agreed=_agree_candidates(rt, candidates(given)))
    rt.residency = plan
    reuse = (
        rt.reuse.decision
        if rt.reuse is not None
        else ReuseDecision(code=ReuseCode.NO_DECISION.value)
    )
    if rt.args.calibrate and rt.reuse is not None and rt.reuse.stored is not None:
        reuse = replace(reuse, code=ReuseCode.CALIBRATE_ASKED.value)
    rt.recorder.record(ev.ResidencyPlanned(fingerprint=fp, given=given, plan=plan, reuse=reuse))


def _apply(rt: RankRuntime, plan: ResidencyPlan, *, reused_from: str | None) -> str | None:
    """Apply `plan` to the pipeline and journal it; why it failed, or None."""
    pipeline = resident(rt.pipeline)
    assert pipeline is not None and rt.fingerprint is not None
    started = time.perf_counter()
    try:
        pipeline.apply_residency(plan.choices)
    except Exception as exc:  # any failure to apply rolls every rank back, agreed
        return f"applying {plan.plan_id} failed: {type(exc).__name__}: {exc}"
    rt.recorder.record(
        ev.ResidencyApplied(
            fingerprint=rt.fingerprint,
            plan=plan,
            reused_from=reused_from,
            seconds=time.perf_counter() - started,
        )
    )
    return None


def apply_before_rewarm(rt: RankRuntime) -> None:
    """Apply the agreed plan before the re-warm measures it (re-warm)."""
    plan = rt.residency
    if plan is None or not plan.fits or not plan.changes_residency:
        return
    rt.residency_failure = _apply(rt, plan, reused_from=None)


def apply_reused(rt: RankRuntime) -> None:
    """Apply the verified plan the ranks agreed to reuse, before the bounded warmup measures
    it (bounded-warm); a failure rolls every rank back."""
    reused = rt.reused
    if reused is None:
        return
    rt.residency = reused.plan
    failure = _apply(rt, reused.plan, reused_from=reused.verified_in or reused.run_id)
    _agree_outcome(rt, failure, measured=None, predicted=None)


def verify_after_rewarm(rt: RankRuntime) -> None:
    """Hold the re-warm's measured peak to the plan's prediction at its shape and the budget;
    the ranks agree, and all roll back if any failed (re-warm). A plan that keeps the
    reference residency is verified too: it is a plan, and a later startup reuses it."""
    plan = rt.residency
    if plan is None or not plan.fits:
        return
    failure = rt.residency_failure
    measured = predicted = None
    times: tuple[float, float] | None = None
    rewarm, bounded = rt.measured.get(Role.REWARM), rt.measured.get(Role.BOUNDED)
    if failure is None and rewarm is not None and bounded is not None:
        by_name = {(o.component, o.name): o for o in _options(rt, Role.REWARM)}
        choices = [by_name.get((o.component, o.name), o) for o in plan.choices]
        predicted, predicted_s = predict(bounded.baseline_bytes or 0, _costs(bounded), choices)
        # What the process held before the re-warm beyond what it held before the bounded
        # warmup (the probe's freed memory, kept by the allocator) is no plan's doing: the
        # prediction is of the request's working memory over the baseline it starts from.
        predicted += max(0, (rewarm.baseline_bytes or 0) - (bounded.baseline_bytes or 0))
        measured = rewarm.peak_bytes or 0
        if rt.over_budget_fault:
            measured = max(measured, plan.budget_bytes + 64 * MIB)
        times = (rewarm.total_s, predicted_s)
        failure = verify_peak(
            measured_bytes=measured, predicted_bytes=predicted, budget_bytes=plan.budget_bytes
        ) or verify_time(measured_s=rewarm.total_s, predicted_s=predicted_s)
    _agree_outcome(rt, failure, measured=measured, predicted=predicted, times=times)


def _agree_outcome(
    rt: RankRuntime,
    failure: str | None,
    *,
    measured: int | None,
    predicted: int | None,
    times: tuple[float, float] | None = None,
) -> None:
    """Exchange every rank's outcome; journal verified, or roll back with the failed ranks."""
    plan, fp = rt.residency, rt.fingerprint
    assert plan is not None and fp is not None
    world = rt.comm.world
    # One slot a rank, set by a rank whose plan failed: the sum says which ranks failed.
    flags = torch.zeros(world.size, dtype=torch.int64)
    flags[world.ranks.index(rt.layout.rank)] = int(failure is not None)
    world.all_reduce(flags, op="sum", purpose="residency-agree")
    failed = agreed_rollback(bool(f) for f in flags.tolist())
    if not failed:
        if measured is not None and predicted is not None:
            rt.recorder.record(
                ev.ResidencyVerified(
                    fingerprint=fp,
                    plan=plan,
                    measured_bytes=measured,
                    predicted_bytes=predicted,
                    measured_s=None if times is None else times[0],
                    predicted_s=None if times is None else times[1],
                )
            )
        return
    reason = failure or f"rank {failed[0]} could not apply or verify the plan"
    pipeline = resident(rt.pipeline)
    assert pipeline is not None
    pipeline.apply_residency(
        reference_choices(pipeline.residency_options(rt.args.model.default_shape))
    )
    rt.residency = None
    rt.recorder.record(
        ev.ResidencyRolledBack(fingerprint=fp, plan=plan, reason=reason, ranks=failed)
    )
