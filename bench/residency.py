"""The residency planner: what its options do to peak memory and time, measured against what
the pipeline declares, and what calibrating once per fingerprint costs a startup.

`python -m bench.residency decode OPTION WIDTH HEIGHT FRAMES` is the worker: one process per
option, so that each peak RSS is its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.calibration import BOUNDED_ENV, Boot, boot_once
from bench.compare import compared_seconds
from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, at_most, format_ratio

REPO = Path(__file__).resolve().parent.parent
DECODER_OPTIONS = ("frames-1", "frames-4", "frames-all", "tiles-2x2")
MIB = 2**20
# A reused plan runs the bounded path: its startup may cost this much more than the bounded
# path without a planner (reading the journal's plans, applying the plan), no more.
REUSE_TARGET = 1.10


def _decode_once(name: str, width: int, height: int, frames: int) -> dict[str, float]:
    """Decode random latents of one shape with one decoder option; peak above the baseline
    before decoding (VmHWM) and seconds, the better of two."""
    import torch

    from lifecycle.core.format.records import Shape
    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.runtime.device import LinuxRssMeter
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    comm = Comm.alone(torch.device("cpu"))
    pipeline = TinyVideoPipeline(MODEL_PRESETS["tiny-video"], comm=comm)
    shape = Shape(width=width, height=height, frames=frames)
    options = pipeline.residency_options(shape)
    chosen = [o for o in options if o.name in (name, "resident")]
    pipeline.apply_residency(chosen)
    latents = torch.randn((1, *pipeline.latent_shape(shape)))
    meter = LinuxRssMeter()
    best_s, peak = float("inf"), 0
    for _ in range(2):
        base = meter.current_bytes() or 0
        meter.reset_peak()
        started = time.perf_counter()
        video = pipeline.decode(latents, shape)
        best_s = min(best_s, time.perf_counter() - started)
        peak = max(peak, (meter.peak_bytes() or 0) - base)
        del video
    declared = next(o for o in options if o.name == name)
    return {
        "seconds": best_s,
        "peak_bytes": peak,
        "peak_scale": declared.peak_scale,
        "time_scale": declared.time_scale,
    }


def _decode_in_process(name: str, shape: tuple[int, int, int]) -> dict[str, float]:
    command = [sys.executable, "-m", "bench.residency", "decode", name, *map(str, shape)]
    done = subprocess.run(
        command, check=False, cwd=REPO, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise BenchError(f"decoding with {name} failed: {done.stderr.strip()[-300:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _decoder_rows(settings: Settings) -> list[Row]:
    shape = (512, 288, 17) if settings.quick else (1280, 720, 81)
    measured = {}
    for name in DECODER_OPTIONS:
        progress(f"residency: decoder {name} at {shape}")
        measured[name] = _decode_in_process(name, shape)
    reference = measured["frames-1"]
    at = "x".join(map(str, shape))
    rows = []
    for name in DECODER_OPTIONS[1:]:
        m = measured[name]
        peak_ratio = m["peak_bytes"] / reference["peak_bytes"]
        rows.append(
            Row(
                figure=f"residency: decoder {name} peak above baseline, {at}",
                value=f"{m['peak_bytes'] / MIB:.0f} MiB",
                baseline=f"{reference['peak_bytes'] / MIB:.0f} MiB frames-1",
                ratio=format_ratio(peak_ratio),
                target=f"declared {m['peak_scale']:.2f}",
                how="VmHWM growth over the decode (reset through clear_refs), one process per"
                " option, tiny-video's decoder on random latents, worse of 2",
            )
        )
        rows.append(
            compared_seconds(
                figure=f"residency: decoder {name} time, {at}",
                value_s=m["seconds"],
                baseline_s=reference["seconds"],
                baseline_note=" frames-1",
                target=f"declared {m['time_scale']:.2f}",
                how="the better of 2 decodes, in the same processes as the peaks",
            )
        )
    return rows


def _boot(settings: Settings, db: Path, model: str, *, disabled: bool) -> Boot:
    env = BOUNDED_ENV if disabled else None
    return boot_once(settings, db=db, model=model, ranks=1, calibrate=False, env=env)


def _startup_rows(settings: Settings) -> list[Row]:
    model = "micro-video" if settings.quick else "tiny-video"
    rounds = 1 if settings.quick else 4
    bounded: list[Boot] = []
    first: list[Boot] = []
    reused: list[Boot] = []
    for index in range(rounds):
        db = settings.workdir / f"residency-{index}.db"
        progress(f"residency: {model} round {index + 1}/{rounds}")
        first.append(_boot(settings, db, model, disabled=False))
        # The two compared sides after the calibration, their order turning each round, so
        # that neither always runs straight after the calibrating boot.
        order = [(settings.workdir / "residency-off.db", True), (db, False)]
        for journal, disabled in order if index % 2 == 0 else order[::-1]:
            boot = _boot(settings, journal, model, disabled=disabled)
            (bounded if disabled else reused).append(boot)
        if bounded[-1].calibrated or not first[-1].calibrated or reused[-1].calibrated:
            raise BenchError("a residency boot did not take the path it was meant to")
    base = median([b.ready_s for b in bounded])
    again = median([b.ready_s for b in reused])
    how = (
        f"`lifecycle boot --model {model}` subprocesses, {rounds} round(s), medians: the first"
        " boot on a fresh journal (calibrates, plans, verifies), then in turn the next boot on"
        " it (reuses) and the bounded path with LIFECYCLE_DISABLE_AUTO_RESIDENCY=1 (the path"
        " before the planner), their order alternating by round"
    )
    return [
        compared_seconds(
            figure=f"residency: startup to ready, reused plan, {model} 1 rank",
            value_s=again,
            baseline_s=base,
            value_note=" reused",
            baseline_note=" bounded",
            target=at_most(again / base, REUSE_TARGET, spec=".2f"),
            how=how,
        ),
        compared_seconds(
            figure=f"residency: startup to ready, first calibration, {model} 1 rank",
            value_s=median([b.ready_s for b in first]),
            baseline_s=base,
            value_note=" calibrated",
            baseline_note=" bounded",
            target="paid once per fingerprint; field 1.242 (62.1 s / 50.0 s, every startup)",
            how=how,
        ),
    ]


def measure(settings: Settings) -> list[Row]:
    return [*_decoder_rows(settings), *_startup_rows(settings)]


BENCHMARK = Benchmark(name="residency", measure=measure)


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] != "decode":
        sys.exit("usage: python -m bench.residency decode OPTION WIDTH HEIGHT FRAMES")
    width, height, frames = (int(v) for v in sys.argv[3:6])
    print(json.dumps(_decode_once(sys.argv[2], width, height, frames)))
