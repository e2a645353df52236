"""The registry of benchmarks that `python -m bench` runs, each a function returning rows."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.table import Row


class BenchError(Exception):
    """A benchmark could not measure: a boot failed, a worker timed out, results disagree."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    """How large a run is and where its files go."""

    quick: bool  # small sizes (the whole run's time: bench.run.QUICK_MINUTES)
    workdir: Path  # a fresh temporary directory, removed after the run


@dataclass(frozen=True, slots=True, kw_only=True)
class Benchmark:
    """One benchmark: `measure` runs it and returns its rows, in table order."""

    name: str
    measure: Callable[[Settings], Sequence[Row]]


# The benchmarks the runner runs, in table order: a module's `BENCHMARK`, or `MODULE:NAME` for
# another of its Benchmarks. A new benchmark is a module with a `BENCHMARK = Benchmark(...)`
# and one line here.
MODULES = (
    "bench.overhead",
    "bench.journal",
    "bench.postgres",
    "bench.calibration",
    "bench.residency",
    "bench.collectives",
    "bench.replay",
    "bench.serving",
    "bench.history",
    "bench.failfast",
    "bench.scale",
    "bench.diffusers",
    "bench.diffusers:SERVING",
    "bench.diffusers:RESIDENCY",
    "bench.nodes",
    "bench.parallelload",
    "bench.keeper",
    "bench.accounted",
    "bench.rankgate",
    "bench.otelexport",
    "bench.compilecache",
    "bench.compilecache:LEARNED_SHAPES",
    "bench.families",
)

_REGISTERED: list[Benchmark] = []


def register(benchmark: Benchmark) -> Benchmark:
    """Add a benchmark after those of MODULES, for code that drives the runner in process."""
    if any(b.name == benchmark.name for b in benchmarks()):
        raise ValueError(f"a benchmark named {benchmark.name!r} is already registered")
    _REGISTERED.append(benchmark)
    return benchmark


def _builtin() -> tuple[Benchmark, ...]:
    # Imported on demand so that `python -m bench --help` stays light.
    found = []
    for entry in MODULES:
        name, _, attr = entry.partition(":")
        benchmark = getattr(importlib.import_module(name), attr or "BENCHMARK")
        if not isinstance(benchmark, Benchmark):
            raise TypeError(f"{entry} is not a Benchmark")
        found.append(benchmark)
    return tuple(found)


def benchmarks() -> tuple[Benchmark, ...]:
    """Every benchmark, in the order the table lists them."""
    return (*_builtin(), *_REGISTERED)


def progress(message: str) -> None:
    """A progress line on stderr, so that stdout carries the table alone."""
    print(f"bench: {message}", file=sys.stderr, flush=True)
