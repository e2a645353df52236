"""The benchmark runner: `python -m bench --quick` runs every benchmark and reports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

# The benchmarks a test runs: the in-process ones, whose quick run takes seconds. The others
# start rank processes, servers and diffusers pipelines for minutes (`python -m bench --quick`
# runs them all; BENCHMARKS.md is their full run).
IN_PROCESS = ("journal", "replay")
ROW_NAMES = (
    "journal append latency, median",
    "journal append latency, p99",
    "journal append throughput, 1 process(es)",
    "journal append throughput, 8 process(es)",
    "replay show, 10,000 events (64 ranks)",
)


@pytest.mark.timeout(240)
def test_a_quick_run_prints_its_rows_and_writes_the_markdown(tmp_path: Path) -> None:
    """A quick run of the in-process benchmarks exits 0, prints a row for each figure and
    writes them to --output with the command that made them."""
    output = tmp_path / "bench.md"
    only = [arg for name in IN_PROCESS for arg in ("--only", name)]
    done = run_cli("bench", ["--quick", *only, "--output", str(output)], cwd=REPO, timeout=200.0)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = [name for name in ROW_NAMES if name not in done.stdout]
    assert missing == [], done.stdout
    markdown = output.read_text(encoding="utf-8")
    assert [name for name in ROW_NAMES if name not in markdown] == []
    assert "--quick --only journal --only replay --output" in markdown


def test_every_benchmark_module_names_one_benchmark_once() -> None:
    """Each module the runner lists holds a Benchmark under a name no other uses, so that
    `--only NAME` picks exactly one."""
    from bench.suite import MODULES, benchmarks

    names = [b.name for b in benchmarks()]
    assert len(names) == len(MODULES) == len(set(names))
    assert {"overhead", "history", "diffusers"} <= set(names)
