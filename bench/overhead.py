"""Lifecycle overhead: startup to `ready` through lifecycle against the same forward passes."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import structlog

from bench.stats import Paired, interleave, median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict
from lifecycle.core.decisions.warmupplan import WarmupPlan
from lifecycle.core.format.events import Event, StoredEvent
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs, SmokeRequest
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.recorder import Recorder
from lifecycle.store.writer import RankWriter

T = TypeVar("T")

RATIO_TARGET = 1.01
PER_STATE_TARGET_S = 5e-3


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """The forward passes one side ran, to check that both sides did the same work, and the
    collector's pauses while it ran."""

    requests: tuple[tuple[str, str, int], ...]  # (role, shape, steps)
    checksums: tuple[str, ...]
    gc_s: float
    work_s: float  # in the pipeline's build and its requests (see WorkClock)


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    model: str
    pairs: int
    discard: int


def plain_plan(args: ServerArgs) -> WarmupPlan:
    """The plan the lifecycle side builds, computed once outside any timed region."""
    import torch

    from lifecycle.core.decisions.gates import calibration_skip_reason
    from lifecycle.core.decisions.warmupplan import plan_for
    from lifecycle.runtime.device import memory_meter, probe_platform

    device = torch.device("cpu")
    platform = probe_platform(device, memory_meter(device), local_ranks=1)
    return plan_for(
        args,
        skip_reason=calibration_skip_reason(args, platform),
        free_bytes=platform.free_bytes,
        total_bytes=platform.total_bytes,
    )


def plain_warmup(args: ServerArgs, plan: WarmupPlan, seen: list[Work]) -> float:
    """Side B: build the pipeline and run the plan's requests in a loop; seconds taken."""
    import torch

    from lifecycle.runtime.actions import warmup_generation
    from lifecycle.runtime.device import memory_meter, release_cache, select_device
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline import build_pipeline
    from lifecycle.runtime.request import run_request

    clock = WorkClock()
    with GcPauses() as pauses:
        started = time.perf_counter()
        device = select_device(args.device, local_rank=0)
        torch.set_num_threads(max(1, os.cpu_count() or 1))
        comm = Comm.alone(device)
        pipeline = clock.timed(build_pipeline, args.model, comm)
        meter = memory_meter(device)
        results = [
            clock.timed(
                run_request,
                pipeline,
                warmup_generation(args, request.shape, request.steps),
                meter=meter,
                device=device,
                decode=True,
            ).result
            for request in plan.requests
        ]
        if plan.calibration_open:
            comm.staging.drop(release_cache=lambda: release_cache(device))
        elapsed = time.perf_counter() - started
    seen.append(
        Work(
            requests=tuple((r.role.value, str(r.shape), r.steps) for r in plan.requests),
            checksums=tuple(r.checksum for r in results),
            gc_s=pauses.total_s,
            work_s=clock.work_s,
        )
    )
    return elapsed


class GcPauses:
    """The collector's pauses while it is entered, summed (gc.callbacks): a pause stops
    every thread, whichever thread's allocation set it off."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.total_s += time.perf_counter() - self._started
            self._started = None


class WorkClock:
    """The time spent in the pipeline's build and its requests, summed: the work both sides
    do, timed around the same calls on each (A makes them through lifecycle.runtime.actions)."""

    def __init__(self) -> None:
        self.work_s = 0.0

    def timed(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.work_s += time.perf_counter() - started

    @contextlib.contextmanager
    def around_actions(self) -> Iterator[None]:
        """Time the session's own calls of build_pipeline and run_request while entered."""
        from lifecycle.runtime import actions
        from lifecycle.runtime.pipeline import build_pipeline as build
        from lifecycle.runtime.request import run_request as run

        def timed_build(*args: Any, **kwargs: Any) -> Any:
            return self.timed(build, *args, **kwargs)

        def timed_run(*args: Any, **kwargs: Any) -> Any:
            return self.timed(run, *args, **kwargs)

        setattr(actions, "build_pipeline", timed_build)  # noqa: B010
        setattr(actions, "run_request", timed_run)  # noqa: B010
        try:
            yield
        finally:
            setattr(actions, "build_pipeline", build)  # noqa: B010
            setattr(actions, "run_request", run)  # noqa: B010


class TimedRecorder(Recorder):
    """A Recorder that also sums the time its owning thread spends in `record` (journal
    commit and structlog rendering): the direct part of the overhead."""

    def __init__(self, writer: RankWriter) -> None:
        super().__init__(writer)
        self._owner = threading.get_ident()
        self.record_s = 0.0
        self.records = 0

    def record(self, event: Event, *, state: State | None = None) -> StoredEvent | None:
        started = time.perf_counter()
        try:
            return super().record(event, state=state)
        finally:
            if threading.get_ident() == self._owner:  # heartbeats run on their own thread
                self.record_s += time.perf_counter() - started
                self.records += 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Boot:
    """What one lifecycle boot did, read back from its journal and its recorder."""

    work: Work
    states: int  # states entered after created, up to ready
    setup_s: float  # journal open, run row, recorder and session, before boot()
    record_s: float  # time in Recorder.record on the booting thread
    records: int
    heartbeat_s: float  # the heartbeat thread's CPU time up to ready


def lifecycle_boot(args: ServerArgs, boots: list[Boot]) -> float:
    """Side A: journal, run row, recorder, RankSession, boot() to ready; seconds taken."""
    from lifecycle.core.format.fold import fold_run
    from lifecycle.runtime.session import RankLaunch, RankSession
    from lifecycle.store.journal import Journal
    from lifecycle.store.runs import new_run_id, run_row

    clock = WorkClock()
    with GcPauses() as pauses, clock.around_actions():
        started = time.perf_counter()
        created_at = time.time()
        journal = Journal.open_for_write(args.db)
        run_id = new_run_id(created_at)
        journal.create_run(run_row(args, run_id=run_id, created_at=created_at))
        recorder = TimedRecorder(journal.writer(run_id=run_id, rank=0))
        launch = RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False)
        session = RankSession(args, launch, recorder)
        setup_s = time.perf_counter() - started
        state = session.boot()
        elapsed = time.perf_counter() - started
        heartbeat_s = session.heartbeat.cpu_s()
    record_s, records = recorder.record_s, recorder.records
    session.stop(reason="benchmark")
    session.close()
    view = fold_run(journal.read(run_id=run_id))[0]
    journal.close()
    if state is not State.READY:
        message = view.errors[0][2].message if view.errors else "no error recorded"
        raise BenchError(f"the lifecycle boot ended {state.value}: {message}")
    boots.append(
        Boot(
            work=Work(
                requests=tuple((w.role.value, str(w.shape), w.steps) for w in view.warmup_records),
                checksums=tuple(w.checksum for w in view.warmup_records),
                gc_s=pauses.total_s,
                work_s=clock.work_s,
            ),
            states=len(view.path) - 1 - view.path.count(State.STOPPED.value),
            setup_s=setup_s,
            record_s=record_s,
            records=records,
            heartbeat_s=heartbeat_s,
        )
    )
    return elapsed


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
            ratio=format_ratio(ratio),
            target=verdict(f"<= {RATIO_TARGET}", met=ratio <= RATIO_TARGET),
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
            ratio=format_ratio(own),
            target=verdict(f"<= {RATIO_TARGET}", met=own <= RATIO_TARGET),
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
