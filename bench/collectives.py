"""stub."""

from __future__ import annotations

from bench.suite import Benchmark, Settings
from bench.table import Row


def measure(settings: Settings) -> list[Row]:
    return []


BENCHMARK = Benchmark(name="collectives", measure=measure)
