"""The two sides the overhead benchmark (bench/overhead.py) times: the plain loop of forward
passes (B) and the same work booted through the lifecycle (A), and what each records of its
run (the work done, the collector's pauses, the recorder's time)."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.suite import BenchError
from lifecycle.core.decisions.warmupplan import WarmupPlan
from lifecycle.core.format.events import Event, StoredEvent
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.recorder import Recorder
from lifecycle.store.writer import RankWriter

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class Work:
    """The forward passes one side ran, to check that both sides did the same work, and the
    collector's pauses while it ran."""

    requests: tuple[tuple[str, str, int], ...]  # (role, shape, steps)
    checksums: tuple[str, ...]
    gc_s: float
    work_s: float  # in the pipeline's build and its requests (see WorkClock)


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
