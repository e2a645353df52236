"""diffusers pipelines through the lifecycle against diffusers alone: tiny-wan's startup to ready
and a /generate set beside `WanPipeline`'s own load and call, CFG-parallel and Ulysses step
times, and the Wan adapter's residency options against what they declare (bench.wanresidency).

Both sides run as child processes on a directory that tiny-wan was saved to: the lifecycle's
`boot`/`serve --model-path`, and bench.wanplain's `WanPipeline.from_pretrained` and call.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.bootrun import BASE_ENV
from bench.stats import Paired, interleave, median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most

STARTUP_TARGET = 1.05
BOOT_TIMEOUT_S = 600.0
# tiny-wan's own default request (tiny_wan_spec); a saved directory's default would be
# WanPipeline's call defaults, 832x480x81 at 50 steps, whose bounded warmup (832x480x17) takes
# most of a minute on two cores.
DEFAULT_SHAPE = (128, 128, 33)
DEFAULT_STEPS = 20
MODEL_ARGS = (
    "--default-shape", "x".join(map(str, DEFAULT_SHAPE)), "--default-steps", str(DEFAULT_STEPS),
)  # fmt: skip
# The same environment for both sides. The lifecycle runs the bounded path as before the
# planner (calibration closed) and so keeps the reference residency, the VAE decoding whole
# and the text encoder resident, which is what WanPipeline does; offline, as the lifecycle
# always loads a directory.
ENV = {"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1", **BASE_ENV}


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    startup_pairs: int
    startup_discard: int
    request: tuple[int, int, int, int]  # /generate's width, height, frames, steps
    rounds: int


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(startup_pairs=1, startup_discard=0, request=(128, 128, 17, 4), rounds=2)
    return Sized(startup_pairs=7, startup_discard=1, request=(256, 256, 33, 10), rounds=7)


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """One side's startup: seconds from process start to ready and to the pipeline loaded,
    the requests it ran (width, height, frames, steps) and their outputs' checksums."""

    ready_s: float
    loaded_s: float
    requests: tuple[tuple[int, int, int, int], ...]
    checksums: tuple[str, ...]


def _save_tiny_wan(workdir: Path) -> Path:
    from lifecycle.adapters.diffusers.wan.tinywan import build_tiny_wan

    directory = workdir / "tiny-wan"
    build_tiny_wan().save_pretrained(str(directory))
    return directory


def _warmup_requests(directory: Path) -> list[dict[str, Any]]:
    """The bounded warmup request the lifecycle runs for the directory (its plan's shape and
    steps, its warmup prompt, guidance and seed), as /generate's body."""
    from lifecycle.adapters.diffusers import spec_for_directory
    from lifecycle.core.decisions.warmupplan import bounded_shape, bounded_steps
    from lifecycle.core.settings.config import ServerArgs
    from lifecycle.runtime.actions import warmup_generation

    width, height, frames = DEFAULT_SHAPE
    spec = dataclasses.replace(
        spec_for_directory(str(directory)),
        default_width=width,
        default_height=height,
        default_frames=frames,
        default_steps=DEFAULT_STEPS,
    )
    shape = bounded_shape(spec)
    generation = warmup_generation(
        ServerArgs(model=spec), shape, bounded_steps(spec, calibration_open=False)
    )
    return [
        {
            "prompt": generation.prompt,
            "negative_prompt": generation.negative_prompt,
            "width": shape.width,
            "height": shape.height,
            "frames": shape.frames,
            "steps": generation.steps,
            "guidance_scale": generation.guidance_scale,
            "seed": generation.seed,
        }
    ]


def _child(command: Sequence[str], workdir: Path) -> str:
    done = subprocess.run(
        command, cwd=workdir, env={**os.environ, **ENV}, capture_output=True, text=True,
        timeout=BOOT_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        said = [*done.stdout.strip().splitlines()[-2:], *done.stderr.strip().splitlines()[-3:]]
        raise BenchError(f"`{' '.join(command[1:4])}` exited {done.returncode}: {' | '.join(said)}")
    return done.stdout


def _lifecycle_startup(directory: Path, db: Path, workdir: Path) -> Started:
    """Side A: `lifecycle boot --model-path`, to the end of the last rank's ready action as its
    journal says (when /health would turn 200)."""
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(str(db)) as journal:
        before = {run.run_id for run in journal.runs()}
    began = time.time()
    _child(
        [sys.executable, "-m", "lifecycle", "boot", "--model-path", str(directory), *MODEL_ARGS,
         "--db", str(db), "--log-level", "warning"],
        workdir,
    )  # fmt: skip
    with Journal.open_for_read(str(db)) as journal:
        (run,) = [run for run in journal.runs() if run.run_id not in before]
        events = list(journal.read(run_id=run.run_id))
    ready_at = [e.wall_time for e in events if e.kind == "action_finished" and e.state == "ready"]
    loaded_at = [
        e.wall_time
        for e in events
        if e.kind == "action_finished" and getattr(e.event, "action", "") == "load-pipeline"
    ]
    records = [e.event for e in events if e.kind == "warmup_record" and e.rank == 0]
    if not ready_at or not loaded_at:
        raise BenchError(f"run {run.run_id} did not journal its pipeline loaded and ready")
    if any(e.kind == "request_started" for e in events):
        raise BenchError(f"run {run.run_id} ran a smoke request: the plain side runs none")
    if any(getattr(r, "role", None) != "bounded" for r in records):
        raise BenchError(f"run {run.run_id} calibrated: the bounded path was meant")
    return Started(
        ready_s=max(ready_at) - began,
        loaded_s=max(loaded_at) - began,
        requests=tuple(
            (r.shape.width, r.shape.height, r.shape.frames, r.steps)  # type: ignore[attr-defined]
            for r in records
        ),
        checksums=tuple(r.checksum for r in records),  # type: ignore[attr-defined]
    )


def _plain_startup(directory: Path, requests: list[dict[str, Any]], workdir: Path) -> Started:
    """Side B: a process that loads the directory with WanPipeline.from_pretrained and calls
    it with the same requests, to the last call's return."""
    spec = json.dumps({"directory": str(directory), "requests": requests})
    began = time.time()
    out = _child([sys.executable, "-m", "bench.wanplain", "startup", spec], workdir)
    doc = json.loads(out.strip().splitlines()[-1])
    return Started(
        ready_s=doc["finished_at"] - began,
        loaded_s=doc["loaded_at"] - began,
        requests=tuple((r["width"], r["height"], r["frames"], r["steps"]) for r in requests),
        checksums=tuple(doc["checksums"]),
    )


def _timed(side: Callable[[], Started], seen: list[Started]) -> Callable[[], float]:
    def run() -> float:
        seen.append(side())
        return seen[-1].ready_s

    return run


def _startup_rows(settings: Settings, sized: Sized, directory: Path) -> list[Row]:
    from lifecycle.store.journal import Journal

    db = settings.workdir / "diffusers-boot.db"
    Journal.open_for_write(str(db)).close()  # migrations once, outside the timed region
    requests = _warmup_requests(directory)
    lifecycle_side: list[Started] = []
    plain_side: list[Started] = []
    progress(f"diffusers: tiny-wan startup, {sized.startup_pairs} interleaved pairs")
    paired: Paired = interleave(
        _timed(lambda: _lifecycle_startup(directory, db, settings.workdir), lifecycle_side),
        _timed(lambda: _plain_startup(directory, requests, settings.workdir), plain_side),
        pairs=sized.startup_pairs,
        discard=sized.startup_discard,
    )
    if {s.requests for s in lifecycle_side} != {s.requests for s in plain_side}:
        raise BenchError(
            f"the two sides ran different warmups: {lifecycle_side[0].requests} against"
            f" {plain_side[0].requests}"
        )
    same = {s.checksums for s in lifecycle_side} == {s.checksums for s in plain_side}
    kept = slice(sized.startup_discard, None)
    width, height, frames, steps = plain_side[0].requests[0]
    request = requests[0]
    loaded_a = median([s.loaded_s for s in lifecycle_side[kept]])
    loaded_b = median([s.loaded_s for s in plain_side[kept]])
    how = (
        f"process start (the parent's clock before it starts the child) to ready;"
        f" {sized.startup_pairs} interleaved pairs ({sized.startup_discard} discarded), values"
        f" are medians, the ratio is the median of the paired ratios (ratio of the medians:"
        f" {format_ratio(paired.ratio)}). A: `lifecycle boot --model-path DIR"
        f" {' '.join(MODEL_ARGS)}` with LIFECYCLE_DISABLE_AUTO_RESIDENCY=1 (the bounded path:"
        f" one warmup request, {width}x{height}x{frames} at {steps} steps; no smoke request,"
        " which auto runs only after drop-buffers), to the end of its ready action in the"
        " journal (when /health turns 200); B: `python -m bench.wanplain startup`: imports"
        " diffusers, WanPipeline.from_pretrained(DIR, local_files_only=True), one call with the"
        f" same request (the warmup prompt, guidance {request['guidance_scale']:g}, seed"
        f" {request['seed']}), to the call's return. DIR: tiny-wan saved by save_pretrained."
        f" Pipeline loaded after {format_seconds(loaded_a)} (A, load-pipeline's end) and"
        f" {format_seconds(loaded_b)} (B); outputs"
        f" {'identical' if same else 'DIFFER'} (checksums)"
    )
    ratio = paired.paired_ratio
    return [
        Row(
            figure="diffusers: tiny-wan startup to ready, bounded path",
            value=format_seconds(median(paired.a)),
            baseline=format_seconds(median(paired.b)) + " WanPipeline",
            **ratio_at_most(ratio, STARTUP_TARGET, spec=".2f"),
            how=how,
        )
    ]


def _without_diffusers() -> list[Row] | None:
    """The row that says why a diffusers benchmark did not run, or None when it can."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return [missing_extra("diffusers: not run", extra="diffusers")]
    return None


def _directory(settings: Settings) -> Path:
    progress("diffusers: saving tiny-wan with save_pretrained")
    return _save_tiny_wan(settings.workdir)


def measure(settings: Settings) -> list[Row]:
    """Startup to ready against WanPipeline's load and call."""
    if (refused := _without_diffusers()) is not None:
        return refused
    return _startup_rows(settings, _sized(settings), _directory(settings))


def measure_serving(settings: Settings) -> list[Row]:
    """/generate against WanPipeline's call, and the parallel layouts' step time."""
    if (refused := _without_diffusers()) is not None:
        return refused
    from bench.wanserving import serving_rows

    sized = _sized(settings)
    return serving_rows(
        settings, _directory(settings), model_args=MODEL_ARGS, env=ENV, request=sized.request,
        rounds=sized.rounds,
    )  # fmt: skip


def measure_residency(settings: Settings) -> list[Row]:
    """The Wan adapter's residency options against what they declare."""
    if (refused := _without_diffusers()) is not None:
        return refused
    from bench.wanresidency import measure_rows

    return measure_rows(settings)


# Three benchmarks, so that each can be rerun alone (`--only NAME --update`): together they
# take about an hour on two cores.
BENCHMARK = Benchmark(name="diffusers", measure=measure)
SERVING = Benchmark(name="diffusers-serving", measure=measure_serving)
RESIDENCY = Benchmark(name="diffusers-residency", measure=measure_residency)
