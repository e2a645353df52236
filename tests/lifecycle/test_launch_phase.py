"""The launch on the clock: a real two-rank `lifecycle boot` prints its launch before `created`
and counts startup to ready from it; every rank journals it; `replay` shows and compares it;
torchrun's agent is the launch of the ranks it starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifecycle.core.format.events import ClockAligned, RunStarted
from lifecycle.runtime.clock import SystemClock, kernel_boot_id
from lifecycle.runtime.group.clocksync import clock_source_id
from lifecycle.serve.ranks import launchtime
from lifecycle.serve.ranks.launchtime import LAUNCHED_AT_ENV, launch_walls, process_started_wall
from lifecycle.store.journal import Journal
from tests.conftest import run_cli
from tests.support.interpreter import run_python
from tests.support.torchrun import torchrun_boot

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

MICRO = ("--model", "micro-video", "--db", "j.db")
# A state line: its name and its duration, as the boot prints them.
STATE_LINE = re.compile(r"^  (\S+) +(\d+\.\d+) s")
READY_LINE = re.compile(r"startup to ready (\d+\.\d+) s \(launch (\d+\.\d+) s, warmup")


@dataclass(frozen=True)
class Booted:
    cwd: Path
    stdout: str
    run_id: str
    created_at: float
    started: dict[int, RunStarted]  # each rank's run_started


def booted(cwd: Path) -> Booted:
    journal = Journal.open_for_read(str(cwd / "j.db"))
    try:
        (run,) = journal.runs()
        events = list(journal.read(run_id=run.run_id))
    finally:
        journal.close()
    started = {s.rank: s.event for s in events if isinstance(s.event, RunStarted)}
    return Booted(cwd, "", run.run_id, run.created_at, started)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Booted:
    cwd = tmp_path_factory.mktemp("launch")
    result = run_cli("lifecycle", ["boot", *MICRO, "--num-ranks", "2"], cwd=cwd, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    found = booted(cwd)
    return Booted(cwd, result.stdout, found.run_id, found.created_at, found.started)


def test_boot_prints_the_launch_before_created(two_ranks: Booted) -> None:
    """The line after the run's is the launch (processes started, and each phase of theirs
    before their first event), then `created`; off a terminal nothing but plain lines."""
    lines = two_ranks.stdout.splitlines()
    assert lines[0].startswith(f"run {two_ranks.run_id}")
    assert lines[1].startswith("  launch ") and "processes started (start +" in lines[1]
    for phase in ("start Python", "import lifecycle", "import torch", "open journal"):
        assert f"{phase} " in lines[1], lines[1]
    assert lines[2].startswith("  created ")
    assert "\x1b" not in two_ranks.stdout and "━" not in two_ranks.stdout


def test_startup_to_ready_counts_from_the_launch(two_ranks: Booted) -> None:
    """The ready line's startup is the launch plus rank 0's states: the table adds up to it,
    and the launch it names is the table's launch line."""
    lines = two_ranks.stdout.splitlines()
    durations = {}
    for line in lines[1:]:
        found = STATE_LINE.match(line)
        if found is None:
            break
        durations[found[1]] = float(found[2])
    assert list(durations) == [
        "launch", "created", "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers"
    ]  # fmt: skip
    ready = next(READY_LINE.search(line) for line in lines if "startup to ready" in line)
    assert ready is not None
    startup, launch = float(ready[1]), float(ready[2])
    assert launch == pytest.approx(durations["launch"], abs=0.0101)
    # Rank 1 may enter ready a moment after rank 0; the startup is its last rank's.
    assert sum(durations.values()) - 0.01 <= startup <= sum(durations.values()) + 0.5
    entered = [float(x) for x in re.findall(r"entered ready after (\d+\.\d+) s", two_ranks.stdout)]
    # Both printed to the hundredth, each rounded on its own: a hundredth apart at most.
    assert len(entered) == 2 and max(entered) == pytest.approx(startup, abs=0.0101)


def test_every_rank_journals_its_launch(two_ranks: Booted) -> None:
    """Each rank's run_started names the launcher's start (the same for both, and the run's
    recorded start), its own process start after it, and its imports up to its first event."""
    started = two_ranks.started
    assert sorted(started) == [0, 1]
    for event in started.values():
        assert event.launcher_started_wall == pytest.approx(two_ranks.created_at, abs=0.001)
        assert event.process_started_wall is not None and event.imports_s is not None
        assert event.process_started_wall >= event.launcher_started_wall - 0.02
        assert 0 < event.imports_s < 600


def test_ranks_on_one_kernel_take_no_measured_offset(two_ranks: Booted) -> None:
    """Rank 1 runs on rank 0's kernel, so it reads rank 0's wall clock: it journals an offset
    of 0 (not the exchange's noise, milliseconds under load) with the round trip it measured,
    and the same host, and `replay show` says so."""
    journal = Journal.open_for_read(str(two_ranks.cwd / "j.db"))
    try:
        aligned = {
            s.rank: s.event
            for s in journal.read(run_id=two_ranks.run_id)
            if isinstance(s.event, ClockAligned)
        }
    finally:
        journal.close()
    assert sorted(aligned) == [0, 1]
    assert aligned[1].offset_s == 0.0 and aligned[1].round_trip_s > 0
    assert aligned[1].host == aligned[0].host
    shown = run_cli("replay", ["show", "latest", "j.db", "--rank", "1"], cwd=two_ranks.cwd)
    assert f"clock rank 0's (host {aligned[1].host}, one kernel): no offset" in shown.stdout
    assert "against rank 0's" not in shown.stdout


def test_a_clock_names_its_kernel_and_its_skew() -> None:
    """Two clocks of this process have one source; one skewed (standing in for another
    host's) has another, and each source is a number a float64 carries exactly."""
    plain, skewed = SystemClock(), SystemClock(skew_s=30.0)
    assert kernel_boot_id() is not None  # Linux gives one
    assert plain.source() == SystemClock().source() != skewed.source()
    ids = {clock_source_id(c.source()) for c in (plain, skewed)}
    assert len(ids) == 2 and all(0 < i < 2**53 and float(i) == i for i in ids)
    assert clock_source_id(None) == 0


def test_replay_show_gives_each_rank_its_launch(two_ranks: Booted) -> None:
    """`replay show` puts a launch row before `created` in each rank's timeline, at the run's
    start, with the rank's process start and imports; --json the same figures."""
    result = run_cli("replay", ["show", "latest", "j.db"], cwd=two_ranks.cwd, timeout=60)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.split()[1:2] == ["launch"]]
    assert len(rows) == 2
    for row in rows:
        assert row.split()[0] == "+0.00"
        assert "process started +" in row and "in its process before its first event" in row
    as_json = run_cli("replay", ["show", "latest", "j.db", "--json"], cwd=two_ranks.cwd)
    for rank in json.loads(as_json.stdout)["ranks"]:
        launch = rank["launch"]
        created = rank["spans"][0]
        assert created["state"] == "created"
        # Both ranks read one kernel's clock: no measured offset moves rank 1's times (the
        # run's start is the launcher's to the millisecond).
        assert launch["at_s"] == pytest.approx(0.0, abs=0.002)
        assert launch["launch_s"] == pytest.approx(created["at_s"], abs=0.002)
        assert launch["imports_s"] > 0 and launch["process_started_s"] >= 0


def test_replay_diff_and_runs_count_from_the_launch(two_ranks: Booted) -> None:
    """`replay diff` compares each side's launch and imports; `replay runs` and `diagnose` give
    the startup to ready the boot printed, from the launch."""
    diff = run_cli(
        "replay", ["diff", two_ranks.run_id, two_ranks.run_id, "j.db"], cwd=two_ranks.cwd
    )
    assert diff.returncode == 0, diff.stderr
    launch_row = next(line for line in diff.stdout.splitlines() if line.startswith("launch "))
    assert len(re.findall(r"\d+\.\d+ s", launch_row)) == 2
    assert "launch " in diff.stdout.splitlines()[-1]
    assert any(line.startswith("imports ") for line in diff.stdout.splitlines())
    runs = run_cli("replay", ["runs", "j.db", "--json"], cwd=two_ranks.cwd)
    (row,) = json.loads(runs.stdout)
    printed = READY_LINE.search(two_ranks.stdout)
    assert printed is not None
    assert row["startup_to_ready_s"] == pytest.approx(float(printed[1]), abs=0.0101)
    diagnose = run_cli("replay", ["diagnose", "latest", "j.db"], cwd=two_ranks.cwd)
    said = re.search(r"every rank reached ready in (\d+\.\d+) s from the launch", diagnose.stdout)
    assert said is not None, diagnose.stdout
    # The boot's console and replay each round the same startup to two decimals; where it
    # falls on a half hundredth they may print neighbours (24.33 and 24.32).
    assert float(said[1]) == pytest.approx(float(printed[1]), abs=0.011)


def test_under_torchrun_the_launch_is_the_agents_start(tmp_path: Path) -> None:
    """A rank torchrun starts counts its launch from torchrun's agent process, which began
    before it, and the run begins there too."""
    proc = torchrun_boot(tmp_path, 1, *MICRO, "--warmup-mode", "none", env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = booted(tmp_path)
    event = found.started[0]
    assert event.launcher_started_wall is not None and event.process_started_wall is not None
    # torchrun imports torch and sets up its rendezvous before it starts a worker.
    assert event.process_started_wall - event.launcher_started_wall > 0.2
    assert found.created_at == pytest.approx(event.launcher_started_wall, abs=0.001)


def test_a_launch_time_not_before_this_process_is_not_taken() -> None:
    """LIFECYCLE_LAUNCHED_AT is taken when it is before this process's start and within a day
    of it; a later time, a stale one or a word leaves the process its own launcher."""
    mine = process_started_wall()
    assert mine is not None and mine <= time.time()
    earlier = mine - 3.0
    # This test's process has run programs of its own: it says it had not, as a rank has not.
    given = {LAUNCHED_AT_ENV: repr(earlier)}
    assert launch_walls(given, entered_at=0.0, ran_before=False) == (
        pytest.approx(earlier),
        pytest.approx(mine, abs=0.02),
    )
    for value in (repr(mine + 60), repr(mine - 3 * 86_400), "soon", "nan"):
        launched, process = launch_walls({LAUNCHED_AT_ENV: value}, entered_at=0.0, ran_before=False)
        assert launched == process == pytest.approx(mine, abs=0.02)


def test_a_process_a_shell_execd_into_counts_its_launch_from_its_entry() -> None:
    """`bash -c "pip install . && lifecycle boot"` execs the command in the shell's own process,
    whose start (what /proc gives) came before everything the shell ran first: such a start is
    not taken for the launch, the entry is, however short what ran first. A real shell that
    runs a real program, then a real exec; Python started directly keeps its own start."""
    code = (
        "import time; from lifecycle.serve.ranks import launchtime as lt;"
        " now = time.time(); launched, process = lt.launch_walls({}, entered_at=now);"
        " print(now - launched, now - process, now - lt.process_started_wall())"
    )
    shell = f'sleep 0.5; exec {sys.executable} -c "{code}"'
    done = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    launched_ago, process_ago, pid_ago = map(float, done.stdout.split())
    assert pid_ago >= 0.49  # the process began with the shell, before its sleep
    assert launched_ago == process_ago == 0.0  # the launch is the entry, not the shell's start
    direct = run_python(code)
    launched_ago, process_ago, pid_ago = map(float, direct.stdout.split())
    assert launched_ago == process_ago == pid_ago < 2.0  # started as Python: its own start


def test_a_start_long_before_the_entry_is_not_taken_even_with_no_program_run_first() -> None:
    """A shell may exec after its builtins alone, which leave no trace: a start more than
    PRE_ENTRY_MAX_S before the entry is not taken either; one within it is."""
    mine = process_started_wall()
    assert mine is not None
    late = mine + launchtime.PRE_ENTRY_MAX_S + 1.0
    assert launch_walls({}, entered_at=late, ran_before=False) == (late, late)
    soon = mine + launchtime.PRE_ENTRY_MAX_S - 1.0
    assert launch_walls({}, entered_at=soon, ran_before=False) == (mine, mine)
