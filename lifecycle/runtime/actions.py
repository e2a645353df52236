"""What runs on entering each state: real forward passes, buffer drops, and their records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

import structlog
import torch

from lifecycle.core.decisions.agreement import (
    agreed_decision,
    agreed_probe_shape,
    first_failed_gate,
    reuse_token,
)
from lifecycle.core.decisions.deadlines import StartupPath, expect, history_key, runs_of
from lifecycle.core.decisions.fingerprint import Reuse
from lifecycle.core.decisions.gates import RESIDENCY_GATE_INDEX, evaluate_gates
from lifecycle.core.decisions.warmupplan import (
    PROBE_DOES_NOT_FIT,
    WarmupPlan,
    bounded_shape,
    bounded_steps,
    build_plan,
    fit_probe,
)
from lifecycle.core.errors import JournalError
from lifecycle.core.format.events import (
    GateDecided,
    PlanBuilt,
    WarmupRecord,
)
from lifecycle.core.format.records import (
    Generation,
    ReuseCode,
    Role,
    Shape,
    WarmupRequest,
    shared_fields,
)
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs, SmokeRequest
from lifecycle.runtime.compiler import compile_denoiser, keep_compiled
from lifecycle.runtime.device import probe_platform, release_cache
from lifecycle.runtime.group.gatecheck import check_ranks as check_group
from lifecycle.runtime.keeping.sleeping import restore_weights
from lifecycle.runtime.keeping.weightpath import (
    check_reference,
    load_or_attach,
    reference_key,
    reject_attached,
)
from lifecycle.runtime.learned import agreed_shapes, chosen_shapes
from lifecycle.runtime.phases import recording_loads
from lifecycle.runtime.pipeline import build_pipeline
from lifecycle.runtime.rankruntime import RankRuntime
from lifecycle.runtime.request import generate, run_request
from lifecycle.runtime.residency import (
    apply_before_rewarm,
    apply_reused,
    find_reuse,
    plan_after_probe,
    verify_after_rewarm,
)
from lifecycle.store.learned.history import HistoryRead

log = structlog.get_logger("lifecycle.runtime")

WARMUP_PROMPT = "a red fox runs through fresh snow at dawn, cinematic"


# -- gate-check ----------------------------------------------------------------------------


def load_pipeline(rt: RankRuntime) -> None:
    """The pipeline's finished weights: attached from the host's keeper where it holds them,
    else built from disk (each component's load journaled as it happens) and given to it."""
    load_or_attach(rt, _load_from_disk)


def _load_from_disk(rt: RankRuntime) -> None:
    with recording_loads(rt.recorder):
        rt.pipeline = build_pipeline(rt.args.model, rt.comm)


def check_ranks(rt: RankRuntime) -> None:
    """What every rank runs on, agreed, and each rank's speed measured against its group's
    (runtime.group.gatecheck): the startup fails here, before any warmup, on a difference
    that changes numerics, or a slow rank under --on-slow-rank fail."""
    rt.slowdown.forgive()  # a slowed rank's load from disk is not the compute it slows
    check_group(
        args=rt.args,
        comm=rt.comm,
        recorder=rt.recorder,
        device=rt.device,
        pipeline=rt.pipeline,
        stretch=rt.slowdown.stretch,
    )


def decide_path(rt: RankRuntime) -> None:
    """Probe the platform, look for a verified residency plan to reuse, evaluate the gates,
    agree with every rank, build the plan."""
    args, world = rt.args, rt.comm.world
    platform = probe_platform(rt.device, rt.meter, local_ranks=rt.local_ranks)
    rt.platform = platform
    reuse = rt.reuse = find_reuse(rt, platform)
    reusing = reuse.reason if reuse.stored is not None and not args.calibrate else None
    outcomes = evaluate_gates(args, platform, reuse=reusing)
    local_reason = next((o.reason for o in outcomes if not o.passed), None)
    first = first_failed_gate(outcomes)
    # Exchanging the minimum is enough to agree on the earliest failing gate; whether any rank
    # attached or has a keeper rides along, negated (the minimum of -x is -max(x)).
    decision = torch.tensor([first, -int(rt.attached), -int(rt.keeper is not None)])
    world.all_reduce(decision, op="min", purpose="gate-agree")
    rt.group_keeping = bool(decision[1:].min().item() < 0)
    rows = [[int(decision[0].item()), 0]]
    if rows[0][0] == RESIDENCY_GATE_INDEX:
        # Some rank would reuse a plan (or has no planner): which plan, rank by rank. Every
        # row starts as this rank's own, should the gather not run.
        mine = torch.tensor([first, reuse_token(reusing)], dtype=torch.int64)
        everyone = mine.repeat(world.size, 1)
        world.all_gather(everyone, mine, purpose="reuse-agree")
        rows = everyone.tolist()
    skip_reason, reused = agreed_decision([r[0] for r in rows], [r[1] for r in rows], reusing)
    if reused:
        rt.reused = reuse.stored
    elif reusing is not None:
        not_every = replace(reuse.decision, code=ReuseCode.NOT_EVERY_RANK.value)
        rt.reuse = Reuse(stored=None, decision=not_every)
    rt.recorder.record(
        GateDecided(
            gates=outcomes,
            platform=platform,
            skip_reason=skip_reason,
            local_skip_reason=local_reason,
        )
    )
    fit = None
    probe_shape: Shape | None = None
    if skip_reason is None and args.warmup_mode.value == "server":
        fit = fit_probe(args, free_bytes=platform.free_bytes, total_bytes=platform.total_bytes)
        probe_shape = _agree_probe_shape(rt, fit.fitted)
        if probe_shape is None:
            skip_reason = PROBE_DOES_NOT_FIT
    rt.plan = build_plan(args, skip_reason=skip_reason, fit=fit, probe_shape=probe_shape)
    rt.recorder.record(
        PlanBuilt(
            skip_reason=rt.plan.skip_reason,
            requests=rt.plan.requests,
            probe_fit=rt.plan.probe_fit,
        )
    )
    expect_durations(rt)


def expect_durations(rt: RankRuntime) -> None:
    """Journal what this startup expects of each state ahead, now that its path is known:
    each state's time in the journal's earlier healthy runs of its fingerprint and path, and
    the deadline the heartbeat thread holds the state to. A history that cannot be read is
    none: the fixed --state-deadline applies."""
    assert rt.fingerprint is not None and rt.plan is not None
    if rt.plan.calibration_open:
        path = StartupPath.CALIBRATED
    else:
        path = StartupPath.REUSED if rt.reused is not None else StartupPath.BOUNDED
    key = history_key(rt.fingerprint.key, path)
    try:
        found = rt.recorder.startup_history(key, ranks=rt.args.num_ranks)
    except JournalError:
        found = HistoryRead([])
    if found.skipped:
        log.warning("history_rows_skipped", rows=len(found.skipped), first=found.skipped[0])
    history = runs_of(found.rows)
    rt.recorder.record(expect(key, history))


def _agree_probe_shape(rt: RankRuntime, mine: Shape | None) -> Shape | None:
    """The smallest fitted probe among all ranks; None when any rank fits none."""
    world = rt.comm.world
    local = torch.tensor(
        [mine.width, mine.height, mine.frames] if mine else [0, 0, 0], dtype=torch.int64
    )
    everyone = torch.empty((world.size, 3), dtype=torch.int64)
    world.all_gather(everyone, local, purpose="probe-agree")
    return agreed_probe_shape(
        Shape(width=int(w), height=int(h), frames=int(f)) for w, h, f in everyone.tolist()
    )


# -- warmup --------------------------------------------------------------------------------


def _plan(rt: RankRuntime) -> WarmupPlan:
    assert rt.plan is not None, "decide-path builds the plan before any warmup"
    return rt.plan


def _warm(rt: RankRuntime, request: WarmupRequest) -> None:
    assert rt.pipeline is not None
    result = run_request(
        rt.pipeline,
        warmup_generation(rt.args, request.shape, request.steps),
        meter=rt.meter,
        device=rt.device,
        decode=rt.decodes,
    ).result
    rt.measured[request.role] = result
    rt.recorder.record(
        WarmupRecord(
            role=request.role,
            tokens=rt.args.model.tokens(request.shape),
            **shared_fields(result, WarmupRecord),
        )
    )


def bounded_warm(rt: RankRuntime) -> None:
    for request in _plan(rt).by_role(Role.BOUNDED):
        _warm(rt, request)


def verify_weights(rt: RankRuntime, *, always: bool = False) -> None:
    """Hold the fixed request's output (the bounded shape at a plain startup's steps: the
    bounded warmup's own, or one run for it) to the weights key's reference before the startup
    may be ready: a rank whose attached weights do not reproduce it loads from disk, and every
    rank runs the request again (fail closed). A startup with no keeper and no warmup of that
    request pays nothing; a wake (`always`) runs it whatever."""
    world, model = rt.comm.world, rt.args.model
    shape, steps = bounded_shape(model), bounded_steps(model, calibration_open=False)
    bounded = rt.measured.get(Role.BOUNDED)
    free = (
        bounded
        if bounded is not None and (bounded.shape, bounded.steps) == (shape, steps)
        else None
    )
    if free is None and not rt.group_keeping and not always:
        return
    ref_key = reference_key(rt, str(shape), steps)
    for attempt in range(2):
        result = free if attempt == 0 else None
        if result is None:
            request = warmup_generation(rt.args, shape, steps)
            result = generate(rt, request, source="verify").result
        why = None if result.checksum is None else check_reference(rt, result.checksum, ref_key)
        rejected = torch.tensor([int(why is not None)], dtype=torch.int64)
        world.all_reduce(rejected, op="max", purpose="verify-agree")
        if not int(rejected.item()) or attempt == 1:
            return
        if rt.attached:
            reject_attached(rt, why or "a peer's attached weights were rejected", _load_from_disk)
        if rt.args.enable_torch_compile:
            compile_denoiser(rt)
        apply_reused(rt)


def warm_learned(rt: RankRuntime) -> None:
    """The shapes traffic used and --warm-shape's, as every rank agreed (runtime.learned)."""
    mine = chosen_shapes(rt) if rt.layout.rank == 0 else []
    for shape, steps in agreed_shapes(rt, mine):
        _warm(rt, WarmupRequest(role=Role.LEARNED, shape=shape, steps=steps))


def probe(rt: RankRuntime) -> None:
    for request in _plan(rt).by_role(Role.PROBE):
        _warm(rt, request)


def re_warm(rt: RankRuntime) -> None:
    for request in _plan(rt).by_role(Role.REWARM):
        _warm(rt, request)


# -- drop-buffers and ready ----------------------------------------------------------------


def drop_buffers(rt: RankRuntime) -> None:
    rt.comm.staging.drop(release_cache=lambda: release_cache(rt.device))
    rt.dropped_buffers = True


def ready(rt: RankRuntime) -> None:
    mode = rt.args.smoke_request
    if mode is SmokeRequest.ON or (mode is SmokeRequest.AUTO and rt.dropped_buffers):
        # The first request after drop-buffers creates the staging buffers again; run it
        # before /health turns green so that a rank that cannot is caught at startup.
        model = rt.args.model
        generate(
            rt,
            warmup_generation(
                rt.args, bounded_shape(model), bounded_steps(model, calibration_open=False)
            ),
            source="smoke",
        )


def warmup_generation(args: ServerArgs, shape: Shape, steps: int) -> Generation:
    """A warmup's (or smoke request's) request: the fixed prompt, the model's guidance, the
    run's seed."""
    return Generation(
        prompt=WARMUP_PROMPT,
        shape=shape,
        steps=steps,
        guidance_scale=args.model.default_guidance_scale,
        seed=args.seed,
    )


Action = Callable[[RankRuntime], None]

# The actions each state runs on entry, in order, by name: declared once. A test holds this
# to the states the transition table says run actions (ACTION_STATES).
STARTUP_ACTIONS: Mapping[State, tuple[tuple[str, Action], ...]] = MappingProxyType(
    {
        State.GATE_CHECK: (
            ("load-pipeline", load_pipeline),
            ("check-ranks", check_ranks),
            ("decide-path", decide_path),
            ("compile", compile_denoiser),
        ),
        State.BOUNDED_WARM: (
            ("apply-reused-residency", apply_reused),
            ("bounded-warmup", bounded_warm),
            ("verify-weights", verify_weights),
            ("warm-learned-shapes", warm_learned),
        ),
        State.PROBE: (("probe", probe), ("plan-residency", plan_after_probe)),
        State.RE_WARM: (
            ("apply-residency", apply_before_rewarm),
            ("re-warmup", re_warm),
            ("verify-residency", verify_after_rewarm),
        ),
        State.DROP_BUFFERS: (("drop-buffers", drop_buffers),),
        State.READY: (("keep-compiled", keep_compiled), ("mark-ready", ready)),
    }
)

# The actions that run only under some settings, by name; every other runs on every startup.
ACTION_RUNS_WHEN: Mapping[str, Callable[[ServerArgs], bool]] = MappingProxyType(
    {
        "compile": lambda args: args.enable_torch_compile,
        "keep-compiled": lambda args: args.enable_torch_compile,
    }
)


def action_runs(name: str, args: ServerArgs) -> bool:
    """Whether the action `name` runs on a startup of `args`."""
    when = ACTION_RUNS_WHEN.get(name)
    return when is None or when(args)


def wake_weights(rt: RankRuntime) -> None:
    """The weights back after a sleep, as gate-check got them, and held to the reference."""
    restore_weights(
        rt, load=_load_from_disk, compile_pipeline=compile_denoiser, apply_residency=_reapply
    )
    verify_weights(rt, always=True)


def _reapply(rt: RankRuntime) -> None:
    """The residency plan this rank ran with before its sleep, applied to its new pipeline."""
    if rt.reused is not None:
        apply_reused(rt)
    elif rt.residency is not None and rt.residency.fits and rt.residency.changes_residency:
        apply_before_rewarm(rt)
