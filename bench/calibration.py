"""Calibration cost: real `lifecycle boot` runs, bounded path against calibrated path."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.bootrun import run_ids, run_to_exit
from bench.compare import compared_seconds
from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row

BOOT_TIMEOUT_S = {True: 180.0, False: 600.0}  # quick, full
FOUR_RANKS = ("--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2")
# Auto mode calibrates a pipeline that declares residency options: the bounded side closes
# calibration as before the planner, and `--calibrate` opens it again on the other.
BOUNDED_ENV = {"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Boot:
    """What one boot's journal says: the figures of its slowest rank."""

    ready_s: float  # runs.created_at (the launcher's start) to the last rank entering ready
    warmup_s: float  # the slowest rank's warmup requests, summed (their recorded total_s)
    requests: int
    steps: int
    calibrated: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One figure of a boot, and the field's value of it without and with calibration."""

    name: str
    of: Callable[[Boot], float]
    measured: str
    field_without_s: float
    field_with_s: float
    field_quoted: str

    @property
    def field_ratio(self) -> float:
        return self.field_with_s / self.field_without_s


# The field's 2xH200 text-to-video server in auto mode (the field's failure, docs/index.md).
FIGURES = (
    Figure(
        name="startup to ready",
        of=lambda boot: boot.ready_s,
        measured="runs.created_at to the last rank entering ready",
        field_without_s=50.0,
        field_with_s=62.1,
        field_quoted="62.1 s / 50.0 s to healthy",
    ),
    Figure(
        name="warmup",
        of=lambda boot: boot.warmup_s,
        measured="warmup_record total_s summed",
        field_without_s=2.7,
        field_with_s=9.0,
        field_quoted="about 9 s / 2.7 s of server warmup",
    ),
)


def boot_once(
    settings: Settings,
    *,
    db: Path,
    model: str,
    ranks: int,
    calibrate: bool,
    env: Mapping[str, str] | None = None,
) -> Boot:
    """Run `python -m lifecycle boot` to completion, with `env` added to the environment, and
    read its run back."""
    from lifecycle.core.format.fold import fold_run
    from lifecycle.store.journal import Journal

    before = run_ids(db)
    command = [
        sys.executable,
        "-m",
        "lifecycle",
        "boot",
        "--db",
        str(db),
        "--model",
        model,
        "--log-level",
        "warning",
        *(FOUR_RANKS if ranks == 4 else ()),
        *(("--calibrate",) if calibrate else ()),
    ]
    run_to_exit(
        command,
        cwd=settings.workdir,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
        timeout_s=BOOT_TIMEOUT_S[settings.quick],
        ranks=ranks,
    )
    with Journal.open_for_read(str(db)) as journal:
        new = [run for run in journal.runs() if run.run_id not in before]
        if len(new) != 1:
            raise BenchError(f"expected one new run in {db}, found {len(new)}")
        run = new[0]
        views = fold_run(journal.read(run_id=run.run_id))
    if len(views) != ranks:
        raise BenchError(f"run {run.run_id} journaled {len(views)} ranks, expected {ranks}")
    ready_at = [v.entered_at("ready") for v in views.values()]
    if any(at is None for at in ready_at):
        raise BenchError(f"run {run.run_id}: a rank never reached ready")
    warmups = [v.warmup_records for v in views.values()]
    slowest = max(warmups, key=lambda records: sum(w.total_s for w in records))
    return Boot(
        ready_s=max(at for at in ready_at if at is not None) - run.created_at,
        warmup_s=sum(w.total_s for w in slowest),
        requests=len(slowest),
        steps=sum(w.steps for w in slowest),
        calibrated=all(v.calibrated for v in views.values()),
    )


def _rows_for(settings: Settings, *, model: str, ranks: int, pairs: int) -> list[Row]:
    db = settings.workdir / f"calibration-{ranks}.db"
    bounded: list[Boot] = []
    calibrated: list[Boot] = []
    for index in range(pairs):
        order = (False, True) if index % 2 == 0 else (True, False)
        for calibrate in order:
            progress(
                f"calibration: {model}, {ranks} rank(s), pair {index + 1}/{pairs},"
                f" {'calibrated' if calibrate else 'bounded'}"
            )
            boot = boot_once(
                settings,
                db=db,
                model=model,
                ranks=ranks,
                calibrate=calibrate,
                env=None if calibrate else BOUNDED_ENV,
            )
            if boot.calibrated != calibrate:
                raise BenchError(
                    f"a boot {'with' if calibrate else 'without'} --calibrate took the"
                    f" {'calibrated' if boot.calibrated else 'bounded'} path"
                )
            (calibrated if calibrate else bounded).append(boot)
    layout = "1 rank" if ranks == 1 else "4 ranks (cfg 2 x ulysses 2)"
    work = (
        f"calibrated ran {calibrated[0].requests} warmup request(s), {calibrated[0].steps} steps;"
        f" bounded ran {bounded[0].requests}, {bounded[0].steps} steps"
    )
    how = (
        f"`lifecycle boot --model {model}{' ' + ' '.join(FOUR_RANKS) if ranks == 4 else ''}"
        f" [--calibrate] --log-level warning` subprocesses, {pairs} interleaved pair(s),"
        f" medians; read back from the journal (fold_run), slowest rank; {work}"
    )
    return [
        compared_seconds(
            figure=f"calibration cost, {figure.name}, {layout}",
            value_s=median([figure.of(b) for b in calibrated]),
            baseline_s=median([figure.of(b) for b in bounded]),
            value_note=" calibrated",
            baseline_note=" bounded",
            target=f"no target; field {figure.field_ratio:.3f} ({figure.field_quoted})",
            how=f"{figure.measured}; {how}",
        )
        for figure in FIGURES
    ]


def measure(settings: Settings) -> list[Row]:
    model = "micro-video" if settings.quick else "tiny-video"
    pairs = 1 if settings.quick else 3
    return [
        *_rows_for(settings, model=model, ranks=1, pairs=pairs),
        *_rows_for(settings, model=model, ranks=4, pairs=pairs),
    ]


BENCHMARK = Benchmark(name="calibration", measure=measure)
