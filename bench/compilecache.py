"""Compile and shapes paid once per fingerprint (docs/compile.md), each figure a ratio within one
run:

- the compile of a second `--compile` boot, in a compiler cache folder of its own (every rank
  makes a new one: a fresh machine, to the compiler) with the same journal, from the artifact
  the first kept / the first's cold compile; tiny-wan and tiny-video on SQLite, tiny-wan on
  PostgreSQL (target at most 0.3);
- startup to ready of that second `--compile` boot / an eager boot of the same journal;
- `learned-shapes`, a benchmark of its own: a served request at a shape that the journal's
  traffic used, after a restart that warmed it, the first / the steady state (the median of
  the requests after it), with and without `--compile` (target at most 1.05), and, for
  contrast, at a shape nothing warmed; a compiled request / an eager one at that shape.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.bootrun import run_to_exit
from bench.serving import Model, serving
from bench.stats import median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, ratio_at_most

COMPILE_TARGET = 0.3
FIRST_REQUEST_TARGET = 1.05
BOOT_TIMEOUT_S = 1800.0
LEARNED = {"width": 256, "height": 192, "frames": 9}  # the shape traffic uses
UNLEARNED = {"width": 192, "height": 128, "frames": 5}  # one nothing warmed
STEPS = 4
STEADY = 5  # requests after the first whose median is the steady state
MICRO = Model(label="micro-video", blocks=4, args=("--model", "micro-video"))


@dataclass(frozen=True, slots=True, kw_only=True)
class Compiled:
    seconds: float
    cache: str
    ready_s: float


def _boot(settings: Settings, db: str, model: str, *extra: str) -> Compiled | float:
    """A `lifecycle boot`; with --compile its `compiled` figures, else its startup to ready."""
    from lifecycle.core.format.events import Compiled as CompiledEvent
    from lifecycle.core.format.fold import fold_run
    from lifecycle.store.journal import Journal

    command = [sys.executable, "-m", "lifecycle", "boot", "--model", model, "--db", db,
               "--log-level", "warning", *extra]  # fmt: skip
    run_to_exit(
        command, cwd=settings.workdir, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        timeout_s=BOOT_TIMEOUT_S, ranks=1,
    )  # fmt: skip
    with Journal.open_for_read(db) as journal:
        run = max(journal.runs(), key=lambda r: r.created_at)
        stored = list(journal.read(run_id=run.run_id))
    (view,) = fold_run(stored).values()
    ready_at = view.entered_at("ready")
    if ready_at is None:
        raise BenchError(f"run {run.run_id} never reached ready")
    ready_s = ready_at - run.created_at
    compiled = [s.event for s in stored if isinstance(s.event, CompiledEvent)]
    if "--compile" not in extra:
        return ready_s
    if not compiled:
        raise BenchError(f"run {run.run_id} journaled no compile")
    return Compiled(seconds=compiled[0].seconds, cache=compiled[0].cache, ready_s=ready_s)


def _compile_rows(settings: Settings, label: str, model: str, journals: Iterator[str]) -> list[Row]:
    rounds = 1 if settings.quick else 3
    cold: list[float] = []
    warm: list[float] = []
    compiled_ready: list[float] = []
    eager_ready: list[float] = []
    for n in range(rounds):
        db = next(journals)
        progress(f"compile-cache: {label}, round {n + 1} of {rounds}")
        first = _boot(settings, db, model, "--compile")
        second = _boot(settings, db, model, "--compile")
        eager = _boot(settings, db, model)
        if not isinstance(first, Compiled) or not isinstance(second, Compiled):
            raise BenchError("a --compile boot journaled no compile")
        if (first.cache, second.cache) != ("miss", "hit"):
            raise BenchError(f"{label}: the caches were {first.cache}, {second.cache}")
        assert isinstance(eager, float)
        cold.append(first.seconds)
        warm.append(second.seconds)
        compiled_ready.append(second.ready_s)
        eager_ready.append(eager)
    ratio = median(warm) / median(cold)
    return [
        Row(
            figure=f"compile on a fresh compiler cache, {label}",
            value=format_seconds(median(warm)),
            baseline=format_seconds(median(cold)),
            **ratio_at_most(ratio, COMPILE_TARGET),
            how=f"`compiled` seconds of a second --compile boot (the journal's artifact) / the"
            f" first's cold compile, median of {rounds}",
        ),
        Row(
            figure=f"startup to ready with --compile, second pod, {label}",
            value=format_seconds(median(compiled_ready)),
            baseline=format_seconds(median(eager_ready)),
            ratio=format_ratio(median(compiled_ready) / median(eager_ready)),
            how="the second --compile boot's launch to ready / an eager boot's of the same journal",
        ),
    ]


def _sqlite_journals(settings: Settings, label: str) -> Iterator[str]:
    n = 0
    while True:
        n += 1
        yield str(settings.workdir / f"compile-{label}-{n}.db")


def _postgres_journals(server: object, label: str) -> Iterator[str]:
    n = 0
    while True:
        n += 1
        yield server.create_database(f"compile_{label.replace('-', '_')}_{n}")  # type: ignore[attr-defined]


def _timed(server: object, shape: dict[str, int]) -> float:
    began = time.perf_counter()
    server.generate(STEPS, shape)  # type: ignore[attr-defined]
    return time.perf_counter() - began


@dataclass(frozen=True, slots=True, kw_only=True)
class _Restart:
    """One server restarted on a journal that served LEARNED: its requests' seconds."""

    first: float  # the first request at LEARNED
    steady: float  # the median of the STEADY requests at LEARNED after it
    unlearned: float  # first / steady at UNLEARNED, a shape nothing warmed


def _restarted(settings: Settings, db: Path, extra: tuple[str, ...]) -> _Restart:
    with serving(settings, MICRO, ranks=1, db=db, extra=extra, ready_within=1800) as s:
        for _ in range(2):
            s.generate(STEPS, LEARNED)
    with serving(settings, MICRO, ranks=1, db=db, extra=extra, ready_within=1800) as s:
        first = _timed(s, LEARNED)
        steady = median([_timed(s, LEARNED) for _ in range(STEADY)])
        first_there = _timed(s, UNLEARNED)
        steady_there = median([_timed(s, UNLEARNED) for _ in range(STEADY)])
    return _Restart(first=first, steady=steady, unlearned=first_there / steady_there)


def _first_request_rows(settings: Settings) -> list[Row]:
    """A server that served LEARNED, restarted on its journal: its first request there against
    its steady state, and at a shape nothing warmed, with and without --compile."""
    rounds = 1 if settings.quick else 7
    rows: list[Row] = []
    steady: dict[bool, float] = {}
    for compiled in (False, True):
        extra = ("--compile",) if compiled else ()
        label = "with --compile" if compiled else "eager"
        restarts = []
        for n in range(rounds):
            progress(f"learned-shapes: the shapes traffic used, {label}, round {n + 1}")
            db = settings.workdir / f"shapes-{int(compiled)}-{n}.db"
            restarts.append(_restarted(settings, db, extra))
        steady[compiled] = median([r.steady for r in restarts])
        ratios = [r.first / r.steady for r in restarts]
        ratio = median(ratios)
        interval = median_interval(ratios, confidence=0.9)
        rows.append(
            Row(
                figure=f"first request at a learned shape, {label}",
                value=format_seconds(median([r.first for r in restarts])),
                baseline=format_seconds(steady[compiled]),
                **ratio_at_most(ratio, FIRST_REQUEST_TARGET),
                how=f"POST /generate at {_shape(LEARNED)}, {STEPS} steps, micro-video on 1 rank,"
                " after a restart on a journal that served it: the first / the steady state (the"
                f" median of the {STEADY} requests after it), median of {rounds} restarts, in"
                f" [{format_ratio(interval.low)}, {format_ratio(interval.high)}] with"
                f" {interval.coverage:.1%} confidence (sign test; a single request on CPU varies"
                " by some 15 %)",
            )
        )
        rows.append(
            Row(
                figure=f"first request at a shape nothing warmed, {label}",
                value=format_ratio(median([r.unlearned for r in restarts])),
                how=f"for contrast: POST /generate at {_shape(UNLEARNED)}, the first / the"
                f" median of the {STEADY} after it",
            )
        )
    rows.append(
        Row(
            figure="a compiled request / an eager one",
            value=format_seconds(steady[True]),
            baseline=format_seconds(steady[False]),
            ratio=format_ratio(steady[True] / steady[False]),
            how=f"the steady state at {_shape(LEARNED)} with --compile / without (micro-video,"
            " CPU)",
        )
    )
    return rows


def _shape(shape: dict[str, int]) -> str:
    return f"{shape['width']}x{shape['height']}x{shape['frames']}"


def measure(settings: Settings) -> list[Row]:
    if settings.quick:
        # Each model's three boots take most of a minute on two cores, two of them compiling:
        # a quick run compiles the smallest model on SQLite alone.
        return [
            *_compile_rows(
                settings, "micro-video", "micro-video", _sqlite_journals(settings, "micro-video")
            ),
            Row(
                figure="compile on a fresh compiler cache, tiny-wan, tiny-video, PostgreSQL",
                value="not measured",
                how="--quick measures micro-video on SQLite alone; a full run measures these",
            ),
        ]
    rows = [
        *_compile_rows(settings, "tiny-wan", "tiny-wan", _sqlite_journals(settings, "tiny-wan")),
        *_compile_rows(
            settings, "tiny-video", "tiny-video", _sqlite_journals(settings, "tiny-video")
        ),
    ]
    from tests.pg import bindir, postgres_server

    try:
        bindir()
    except RuntimeError as exc:
        rows.append(Row(figure="compile on PostgreSQL", value="not measured", how=str(exc)))
    else:
        with postgres_server() as server:
            rows += _compile_rows(
                settings, "tiny-wan, PostgreSQL", "tiny-wan", _postgres_journals(server, "wan")
            )[:1]
    return rows


BENCHMARK = Benchmark(name="compile-cache", measure=measure)
# The first requests after a restart: a benchmark of their own, run apart from the compiles.
LEARNED_SHAPES = Benchmark(name="learned-shapes", measure=_first_request_rows)
