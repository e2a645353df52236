"""Lifecycle overhead: startup to `ready` through lifecycle against the same forward passes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog

from bench.overheadsides import Boot, Work, lifecycle_boot, plain_plan, plain_warmup
from bench.stats import Paired, interleave, median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, ratio_at_most, verdict
from lifecycle.core.settings.config import ServerArgs, SmokeRequest
from lifecycle.core.settings.modelspec import MODEL_PRESETS

RATIO_TARGET = 1.01
PER_STATE_TARGET_S = 5e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    model: str
    pairs: int
    discard: int


def _log_stream(workdir: Path) -> TextIO:
    return (workdir / "overhead-structlog.log").open("w", encoding="utf-8")


def _sized(settings: Settings, *, calibrate: bool) -> Sized:
    if settings.quick:
        return Sized(model="micro-video", pairs=2 if calibrate else 4, discard=1)
    return Sized(model="tiny-video", pairs=11 if calibrate else 21, discard=1)


def _path_rows(settings: Settings, *, calibrate: bool) -> list[Row]:
    sized = _sized(settings, calibrate=calibrate)
    path = "calibrated" if calibrate else "bounded"
    db = settings.workdir / f"overhead-{path}.db"
    args = ServerArgs(
        # Without residency options: the planner would change the decoder's work on the
        # lifecycle side only (its cost is bench/residency.py's); --calibrate measures.
        model=dataclasses.replace(MODEL_PRESETS[sized.model], declares_residency=False),
        db=str(db),
        calibrate=calibrate,
        smoke_request=SmokeRequest.OFF,  # the plain loop runs the warmup plan only
    )
    from lifecycle.store.journal import Journal

    Journal.open_for_write(str(db)).close()  # migrations once, outside the timed region
    plan = plain_plan(args)
    progress(f"overhead: {path} path, {sized.model}, {sized.pairs} interleaved pairs")
    boots: list[Boot] = []
    plain_work: list[Work] = []
    paired: Paired = interleave(
        lambda: lifecycle_boot(args, boots),
        lambda: plain_warmup(args, plan, plain_work),
        pairs=sized.pairs,
        discard=sized.discard,
    )
    if {b.work.requests for b in boots} != {w.requests for w in plain_work}:
        raise BenchError(
            f"the two sides ran different warmups: {boots[0].work.requests} against"
            f" {plain_work[0].requests}"
        )
    same_output = {b.work.checksums for b in boots} == {w.checksums for w in plain_work}
    kept = boots[sized.discard :]
    entered = max(b.states for b in kept)
    ratio = paired.paired_ratio
    overhead_s = paired.difference
    per_state_s = overhead_s / entered
    direct_s = median([b.setup_s + b.record_s for b in kept])
    setup_s = median([b.setup_s for b in kept])
    record_s = median([b.record_s for b in kept])
    records = median([b.records for b in kept])
    direct_per_state_s = direct_s / entered
    heartbeat_s = median([b.heartbeat_s for b in kept])
    sides = list(zip([b.work for b in kept], plain_work[sized.discard :], strict=True))
    gc_s = median([a.gc_s - b.gc_s for a, b in sides])
    # A - B = (A's own time - B's) + (A's work - B's): each side's own time is its wall time
    # outside the pipeline's build and requests, which both make the same calls for.
    own_s = median(
        [(wa - a.work_s) - (wb - b.work_s)
         for (a, b), wa, wb in zip(sides, paired.a, paired.b, strict=True)]
    )  # fmt: skip
    slower_s = median([a.work_s - b.work_s for a, b in sides])
    own = (median(paired.b) + own_s) / median(paired.b)
    spread = _spread(paired.a, paired.b)
    work_spread = _spread([a.work_s for a, _ in sides], [b.work_s for _, b in sides])
    requests = plan.requests
    work = (
        f"{len(requests)} request(s), {sum(r.steps for r in requests)} steps"
        f" ({', '.join(f'{r.role.value} {r.shape}x{r.steps}' for r in requests)})"
    )
    how = (
        f"in process, {sized.model}, {work}; {sized.pairs} interleaved pairs"
        f" ({sized.discard} discarded), values are medians, the ratio is the median of the"
        f" paired ratios A/B (ratio of the medians: {format_ratio(paired.ratio)})."
        " A: Journal.open_for_write on a SQLite file, run row,"
        " Recorder, RankSession.boot() with heartbeat thread, structlog at info to a file"
        " (logfmt, as the CLI renders when stderr is not a terminal);"
        " B: Comm + build_pipeline + run_request per request"
        f"{' + staging drop' if plan.calibration_open else ''}; no smoke request;"
        f" outputs {'identical' if same_output else 'DIFFER'} (checksums); the floor: A's"
        f" once-per-boot setup alone ({format_seconds(setup_s)}, below) is"
        f" {setup_s / median(paired.b):.1%} of B; {spread}"
    )
    return [
        Row(
            figure=f"lifecycle overhead, {path} path: startup to ready",
            value=format_seconds(median(paired.a)),
            baseline=format_seconds(median(paired.b)),
            **ratio_at_most(ratio, RATIO_TARGET),
            how=how,
        ),
        Row(
            figure=f"lifecycle overhead, {path} path: per state",
            value=f"{format_seconds(per_state_s)}/state ({format_seconds(overhead_s)} in all)",
            target=verdict(
                f"< {PER_STATE_TARGET_S * 1e3:g} ms/state", met=per_state_s < PER_STATE_TARGET_S
            ),
            how=(
                f"median of paired differences A-B over {sized.pairs} pairs, divided by the"
                f" {entered} states entered after created"
            ),
        ),
        Row(
            figure=f"lifecycle overhead, {path} path: direct cost per state",
            value=f"{format_seconds(direct_per_state_s)}/state ({format_seconds(direct_s)} in all)",
            target=verdict(
                f"< {PER_STATE_TARGET_S * 1e3:g} ms/state",
                met=direct_per_state_s < PER_STATE_TARGET_S,
            ),
            how=(
                "A's own time outside the forward passes, timed inside A: setup"
                f" {format_seconds(setup_s)} (journal open, run row, recorder, session, once per"
                f" boot) + recording {format_seconds(record_s)} (the booting thread's time in"
                f" Recorder.record for {records:.0f} events: JSON encoding, SQLite commit,"
                f" structlog rendering); medians over {len(kept)} boots, divided by {entered}"
                " states; excludes the heartbeat thread, the machine and the gates"
            ),
        ),
        Row(
            figure=f"lifecycle overhead, {path} path: the lifecycle's own time",
            value=f"{format_seconds(own_s)} ({format_seconds(overhead_s)} end to end)",
            baseline=format_seconds(median(paired.b)),
            **ratio_at_most(own, RATIO_TARGET),
            how=(
                "A's wall time outside the pipeline's build and requests (timed around the"
                " same calls on both sides) less B's, median of pairs: every step of the"
                " lifecycle on the booting thread (the setup, the gates, the plan, the expected"
                " times from the journal's history, the recording), of which the direct cost"
                f" above is part; the ratio is (B + that) / B; the target leaves A"
                f" {format_seconds((RATIO_TARGET - 1) * median(paired.b))} in all on this"
                f" startup, against the once-per-boot setup of {format_seconds(setup_s)}"
            ),
        ),
        Row(
            figure=f"lifecycle overhead, {path} path: the same work, slower in A",
            value=format_seconds(slower_s),
            how=(
                "the pipeline's build and requests, timed around the same calls in A and B,"
                " median of paired differences: what the lifecycle takes from the same work"
                " without running in it, and the machine's noise; beside it the heartbeat"
                f" thread's CPU time up to ready ({format_seconds(heartbeat_s)}, its own clock)"
                f" and the collector's pauses in A less those in B ({format_seconds(gc_s)},"
                f" median of pairs, gc.callbacks); for the work's paired ratio, {work_spread}"
            ),
        ),
        Row(
            figure=f"lifecycle overhead, {path} path: recording per state",
            value=f"{format_seconds(record_s / entered)}/state",
            target=verdict(
                f"< {PER_STATE_TARGET_S * 1e3:g} ms/state",
                met=record_s / entered < PER_STATE_TARGET_S,
            ),
            how=(
                f"the booting thread's time in Recorder.record ({format_seconds(record_s)} for"
                f" {records:.0f} events), divided by the {entered} states: what each state"
                " adds; the setup above is paid once per boot whatever the states (opening"
                " the journal checks its schema revision and takes its connections), so its"
                " share per state only falls as a startup has more of them"
            ),
        ),
    ]


def _spread(a: list[float] | tuple[float, ...], b: list[float] | tuple[float, ...]) -> str:
    interval = median_interval([x / y for x, y in zip(a, b, strict=True)])
    return (
        f"the median paired ratio lies in [{format_ratio(interval.low)},"
        f" {format_ratio(interval.high)}] with {interval.coverage:.1%} confidence (sign test)"
    )


def measure(settings: Settings) -> list[Row]:
    import torch  # imported before any timed region: its import is not measured

    from lifecycle.serve.logs import configure_logging

    torch.manual_seed(0)
    with _log_stream(settings.workdir) as stream:
        # As the CLI configures it at info level with stderr redirected (a server's usual
        # case: logfmt lines), to a file so that the table stays readable; the rendering cost
        # is measured with the rest.
        configure_logging(json=False, level="info", stream=stream)
        try:
            return [
                *_path_rows(settings, calibrate=False),
                *_path_rows(settings, calibrate=True),
            ]
        finally:
            structlog.reset_defaults()


BENCHMARK = Benchmark(name="overhead", measure=measure)
