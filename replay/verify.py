"""Deterministic replay against today's code: gates, plan and transitions recomputed (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from lifecycle.core.decisions import agreement
from lifecycle.core.decisions.gates import (
    RESIDENCY_GATE,
    RESIDENCY_PLANNER_NOT_AVAILABLE,
    calibration_skip_reason,
    evaluate_gates,
)
from lifecycle.core.decisions.residencyplanner import replan, same_plan, verify_time
from lifecycle.core.decisions.warmupplan import WarmupPlan, build_plan, fit_probe
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import (
    GateDecided,
    PlanBuilt,
    ResidencyPlanned,
    ResidencyVerified,
    StoredEvent,
    Transition,
)
from lifecycle.core.format.records import WarmupRequest
from lifecycle.core.format.states import State, Trigger, next_state
from lifecycle.core.settings.config import ServerArgs, WarmupMode, args_from_json
from replay.load import RunInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class VerifyReport:
    run_id: str
    divergences: tuple[str, ...]
    checked: tuple[str, ...]

    @property
    def consistent(self) -> bool:
        return not self.divergences


@dataclass
class _RankRecord:
    gate: GateDecided | None = None
    plan: PlanBuilt | None = None
    residency: ResidencyPlanned | None = None
    verified: ResidencyVerified | None = None
    transitions: list[Transition] = field(default_factory=list)


def _collect(events: Iterable[StoredEvent]) -> dict[int, _RankRecord]:
    ranks: dict[int, _RankRecord] = {}
    for stored in events:
        record = ranks.setdefault(stored.rank, _RankRecord())
        event = stored.event
        if isinstance(event, GateDecided):
            record.gate = event
        elif isinstance(event, PlanBuilt):
            record.plan = event
        elif isinstance(event, ResidencyPlanned):
            record.residency = event
        elif isinstance(event, ResidencyVerified):
            record.verified = event
        elif isinstance(event, Transition):
            record.transitions.append(event)
    return ranks


def _requests(requests: tuple[WarmupRequest, ...]) -> str:
    return "[" + ", ".join(f"{r.role} {r.shape} x{r.steps}" for r in requests) + "]"


def _recorded_path(record: _RankRecord) -> str:
    dests = {t.dest for t in record.transitions}
    return "probed" if State.PROBE.value in dests else "skipped the probe"


def verify_run(run: RunInfo, events: Iterable[StoredEvent]) -> VerifyReport:
    """Recompute each rank's gate decision and plan from its recorded config and platform, and
    walk its recorded transitions through today's table; report every divergence."""
    divergences: list[str] = []
    checked: list[str] = []
    try:
        args = args_from_json(run.config)
    except ConfigError as exc:
        return VerifyReport(
            run_id=run.run_id,
            divergences=(f"today's lifecycle cannot read the recorded config: {exc}",),
            checked=(),
        )
    ranks = _collect(events)
    decided = {r: rec for r, rec in ranks.items() if rec.gate is not None}
    first_failed: list[int] = []
    tokens: list[int] = []
    reuses: list[str | None] = []
    for rank, record in sorted(decided.items()):
        assert record.gate is not None
        platform = record.gate.platform
        reuse = _recorded_reuse(record.gate)
        first_failed.append(
            agreement.first_failed_gate(evaluate_gates(args, platform, reuse=reuse))
        )
        tokens.append(agreement.reuse_token(reuse))
        reuses.append(reuse)
        local = calibration_skip_reason(args, platform, reuse=reuse)
        checked.append(f"rank {rank} gates")
        if local != record.gate.local_skip_reason:
            divergences.append(
                f"rank {rank}: recorded gate decision {_reason(record.gate.local_skip_reason)};"
                f" today's gates: {_reason(local)}"
            )
    agreed, _ = agreement.agreed_decision(first_failed, tokens, next(iter(reuses), None))
    divergences.extend(_verify_residency(ranks, checked))
    today_plans = _today_plans(args, decided, agreed)
    for rank, record in sorted(ranks.items()):
        plan = today_plans.get(rank)
        if plan is None:
            continue
        if record.plan is not None:
            checked.append(f"rank {rank} plan")
            if record.plan.skip_reason != plan.skip_reason:
                divergences.append(
                    f"rank {rank}: recorded path {_recorded_path(record)}"
                    f" ({_reason(record.plan.skip_reason)}); today's gates"
                    f" {('skip: ' + plan.skip_reason) if plan.skip_reason else 'calibrate'}"
                )
            elif record.plan.requests != plan.requests:
                divergences.append(
                    f"rank {rank}: recorded plan {_requests(record.plan.requests)};"
                    f" today's plan {_requests(plan.requests)}"
                )
        divergences.extend(_walk(rank, record.transitions, plan.calibration_open))
        checked.append(f"rank {rank} transitions")
    return VerifyReport(run_id=run.run_id, divergences=tuple(divergences), checked=tuple(checked))


def _recorded_reuse(gate: GateDecided) -> str | None:
    """The verified plan a rank found to reuse, as its residency-planner gate recorded it (the
    journal's history at the time is not replayed, only what the rank found in it)."""
    outcome = next((o for o in gate.gates if o.name == RESIDENCY_GATE), None)
    if outcome is None or outcome.passed or outcome.reason == RESIDENCY_PLANNER_NOT_AVAILABLE:
        return None
    return outcome.reason


def _verify_residency(ranks: dict[int, _RankRecord], checked: list[str]) -> list[str]:
    """Decide every rank's residency plan again from the inputs it journaled, agreeing as the
    ranks did, and compare with the plan each recorded."""
    planned = {r: rec.residency for r, rec in sorted(ranks.items()) if rec.residency is not None}
    if not planned:
        return []
    decided = replan([p.given for p in planned.values()])
    if decided is None:
        return ["ranks recorded residency options of different lengths: no common plan"]
    out = _verified_on_time(ranks, checked)
    for (rank, recorded), today in zip(planned.items(), decided, strict=True):
        checked.append(f"rank {rank} residency plan")
        if not same_plan(recorded.plan, today):
            out.append(
                f"rank {rank}: recorded residency plan {recorded.plan.plan_id}"
                f" ({'fits' if recorded.plan.fits else 'none fits'}); today's planner:"
                f" {today.plan_id} ({'fits' if today.fits else 'none fits'})"
            )
    return out


def _verified_on_time(ranks: dict[int, _RankRecord], checked: list[str]) -> list[str]:
    """Hold each verified plan's re-warm time to the planner's prediction, as today's
    verification does (a plan verified before times were journaled is not checked)."""
    out = []
    for rank, record in sorted(ranks.items()):
        verified = record.verified
        if verified is None or verified.measured_s is None or verified.predicted_s is None:
            continue
        checked.append(f"rank {rank} residency time")
        late = verify_time(measured_s=verified.measured_s, predicted_s=verified.predicted_s)
        if late is not None:
            out.append(f"rank {rank}: plan {verified.plan.plan_id} was verified, but {late}")
    return out


def _today_plans(
    args: ServerArgs, decided: dict[int, _RankRecord], agreed: str | None
) -> dict[int, WarmupPlan]:
    """Each rank's plan today, with the probe every rank would agree on (the smallest fit)."""
    fits = {}
    for rank, record in decided.items():
        assert record.gate is not None
        platform = record.gate.platform
        if agreed is None and args.warmup_mode is WarmupMode.SERVER:
            fits[rank] = fit_probe(
                args, free_bytes=platform.free_bytes, total_bytes=platform.total_bytes
            )
    probe = agreement.agreed_probe_shape(f.fitted for f in fits.values())
    plans = {}
    for rank in decided:
        fit = fits.get(rank)
        plans[rank] = build_plan(args, skip_reason=agreed, fit=fit, probe_shape=probe)
    return plans


def _walk(rank: int, transitions: list[Transition], calibration_open: bool) -> list[str]:
    out = []
    state = State.CREATED
    for transition in transitions:
        try:
            trigger = Trigger(transition.trigger)
            source = State(transition.source)
            dest = State(transition.dest)
        except ValueError:
            out.append(
                f"rank {rank}: recorded transition {transition.trigger} {transition.source} ->"
                f" {transition.dest} names a state or trigger today's table does not have"
            )
            return out
        if source is not state:
            out.append(
                f"rank {rank}: recorded {trigger} from {source}, but the rank was in {state}"
            )
        today = next_state(source, trigger, calibration_open=calibration_open)
        if today is not dest:
            out.append(
                f"rank {rank}: recorded {trigger} {source} -> {dest}; today's table"
                + (f" goes to {today}" if today else " refuses it")
                + f" (calibration {'open' if calibration_open else 'closed'})"
            )
        state = dest
    return out


def _reason(reason: str | None) -> str:
    return "calibrate" if reason is None else f"skip: {reason}"


def format_verify(reports: list[VerifyReport]) -> str:
    from lifecycle.core.format.text import clean

    lines = []
    for report in reports:
        if report.consistent:
            lines.append(f"run {report.run_id}: consistent ({len(report.checked)} checks)")
        else:
            lines.append(f"run {report.run_id}: {len(report.divergences)} divergence(s)")
            lines.extend(f"  {clean(d)}" for d in report.divergences)
    return "\n".join(lines)


def verify_json(reports: list[VerifyReport]) -> list[dict[str, object]]:
    return [
        {
            "run_id": r.run_id,
            "consistent": r.consistent,
            "divergences": list(r.divergences),
            "checked": list(r.checked),
        }
        for r in reports
    ]
