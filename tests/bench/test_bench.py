"""The benchmark runner: `python -m bench --quick` runs every benchmark and reports them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
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


@pytest.mark.timeout(240)
def test_an_update_replaces_its_sections_and_keeps_the_others(tmp_path: Path) -> None:
    """`--only NAME --update` reruns one benchmark and replaces its section in the file, keeping
    every other section as its last run wrote it; a file without sections is refused, as one
    line, before anything is measured, and is left as it was."""
    output = tmp_path / "bench.md"
    both = ["--quick", "--only", "journal", "--only", "replay", "--output", str(output)]
    assert run_cli("bench", both, cwd=REPO, timeout=200.0).returncode == 0
    before = output.read_text(encoding="utf-8")
    journal_before = before.split("### journal\n")[1].split("### replay\n")[0]
    again = ["--quick", "--only", "replay", "--update", "--output", str(output)]
    done = run_cli("bench", again, cwd=REPO, timeout=200.0)
    assert done.returncode == 0, done.stderr[-2000:]
    after = output.read_text(encoding="utf-8")
    assert after.split("### journal\n")[1].split("### replay\n")[0] == journal_before
    replay_after = after.split("### replay\n")[1]
    assert "--only replay --update --output" in replay_after
    assert "--only replay --update" not in before
    assert [name for name in ROW_NAMES if name not in after] == []

    flat = tmp_path / "flat.md"
    flat.write_text("# Benchmarks\n\n| figure |\n", encoding="utf-8")
    refused = run_cli("bench", ["--only", "replay", "--update", "--output", str(flat)], cwd=REPO)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"bench: error: cannot update {flat}: it has no Machine or Results section"
    ]
    assert flat.read_text(encoding="utf-8") == "# Benchmarks\n\n| figure |\n"


def test_the_median_interval_is_the_sign_tests_order_statistics() -> None:
    from bench.stats import median_interval

    # n = 11: P(at most 1 of 11 below the median) = 12/2048 <= 2.5 % < P(at most 2) = 67/2048,
    # so the 95 % interval runs from the 2nd to the 10th smallest, covering 1 - 24/2048.
    shuffled = [7.0, 3.0, 11.0, 1.0, 9.0, 5.0, 2.0, 10.0, 4.0, 8.0, 6.0]
    interval = median_interval(shuffled)
    assert (interval.low, interval.high) == (2.0, 10.0)
    assert interval.coverage == 1 - 24 / 2048
    # Too few samples for 95 %: the whole range, with the coverage it has (1 - 2/8).
    few = median_interval([3.0, 1.0, 2.0])
    assert (few.low, few.high, few.coverage) == (1.0, 3.0, 0.75)


def _marked(marker: str) -> list[tuple[int, str]]:
    """Live processes whose environment holds `marker`, with their command lines."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        found.append((int(entry.name), command))
    return found


@pytest.mark.timeout(240)
def test_a_run_stopped_by_a_timeout_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGTERM to `python -m bench` (what `timeout` sends) while a benchmark's server and its
    rank processes run, each in a session of its own: the run ends, and so does every process
    it started."""
    marker = f"LIFECYCLE_BENCH_TEST={uuid.uuid4().hex}"
    name, value = marker.split("=")
    bench = subprocess.Popen(
        [sys.executable, "-m", "bench", "--quick", "--only", "serving"],
        cwd=REPO, env={**os.environ, name: value, "PYTHONWARNINGS": "ignore"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            ranks = [c for _, c in _marked(marker) if "lifecycle.serve.worker" in c]
            if len(ranks) >= 2:
                break
            assert bench.poll() is None, (
                bench.stderr.read().decode()[-2000:] if bench.stderr else ""
            )
            time.sleep(0.2)
        else:
            pytest.fail("the serving benchmark started no rank process within 150 s")
        bench.send_signal(signal.SIGTERM)
        bench.communicate(timeout=60)
        time.sleep(0.5)
        assert _marked(marker) == []
        assert bench.returncode == 128 + signal.SIGTERM
    finally:
        for pid, _ in _marked(marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if bench.poll() is None:
            bench.kill()
            bench.wait(timeout=10)
