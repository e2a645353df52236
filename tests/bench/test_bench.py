"""The benchmark runner: `python -m bench --quick` runs every benchmark and reports them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

# Row names of every benchmark, as a quick run names them.
ROW_NAMES = (
    "lifecycle overhead, bounded path: startup to ready",
    "lifecycle overhead, bounded path: per state",
    "lifecycle overhead, calibrated path: startup to ready",
    "lifecycle overhead, calibrated path: per state",
    "lifecycle overhead, calibrated path: direct cost per state",
    "journal append latency, median",
    "journal append latency, p99",
    "journal append throughput, 1 process(es)",
    "journal append throughput, 8 process(es)",
    "journal append latency on PostgreSQL, median",
    "journal append throughput on PostgreSQL, 8 process(es)",
    "replay diagnose on PostgreSQL, 30,000 events (64 ranks)",
    "calibration cost, startup to ready, 1 rank",
    "calibration cost, warmup, 4 ranks",
    "collective recording, durable (startup)",
    "collective recording, ring (after ready)",
    "replay show, 10,000 events (64 ranks)",
    "journal rows per /generate per rank after ready, healthy",
    "journal rows per /generate per rank after ready, incl. heartbeats",
    "replay diagnose, 30,000 events (64 ranks)",
    "replay diagnose, 10,000 -> 30,000 events (64 ranks)",
    "replay runs, 1,000 runs in one journal",
    "replay runs, time per run (1,000 runs)",
    "replay --help cold start",
)


# About two minutes alone on 2 cores; longer beside another pytest-xdist worker.
@pytest.mark.timeout(480)
def test_quick_run_prints_every_row_and_writes_the_markdown(tmp_path: Path) -> None:
    """A quick run exits 0, prints a row for every benchmark and writes them to --output."""
    output = tmp_path / "bench.md"
    done = run_cli("bench", ["--quick", "--output", str(output)], cwd=REPO, timeout=420.0)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = [name for name in ROW_NAMES if name not in done.stdout]
    assert missing == [], done.stdout
    markdown = output.read_text(encoding="utf-8")
    assert [name for name in ROW_NAMES if name not in markdown] == []
    assert "--quick --output" in markdown
