"""Ranks on hosts whose clocks disagree: each rank measures its clock against rank 0's at the
rendezvous and journals on rank 0's clock, so "failed first" holds across hosts.

One host has one clock: LIFECYCLE_CLOCK_SKEW=RANK:SECONDS gives one real rank process a wall
clock that is off by that much, standing in for another host's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lifecycle.store.journal import Journal
from tests.conftest import one_clear_line, run_cli

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


@pytest.mark.parametrize("skew", [30.0, pytest.param(-30.0, marks=pytest.mark.slow)])
def test_a_rank_whose_clock_is_off_is_still_ordered_by_what_happened(
    tmp_path: Path, skew: float
) -> None:
    """Rank 1's clock is 30 s ahead (or behind); it fails first in drop-buffers and rank 0
    times out waiting for it (as under NCCL's watchdog: --on-peer-failure wait). The verdict
    names rank 1's error as the first, at the time it happened on rank 0's clock, and the
    measured offset is journaled."""
    env = {**os.environ, "LIFECYCLE_CLOCK_SKEW": f"1:{skew}"}
    run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--num-ranks", "2", "--calibrate", "--db", "j.db",
         "--fault", "1:drop-buffers:raise", "--dist-timeout", "4", "--heartbeat-interval", "0.2",
         "--on-peer-failure", "wait", "--log-level", "error"],
        cwd=tmp_path, timeout=180, env=env,
    )  # fmt: skip
    done = run_cli("replay", ["diagnose", "latest", "j.db", "--json"], cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert (doc["outcome"], doc["culprit_ranks"]) == ("hung", [1]), done.stdout
    first = doc["first_error"]
    assert (first["rank"], first["state"]) == (1, "drop-buffers")
    # On rank 0's clock, not 30 s off: before rank 0's own end, which its 4 s timeout (and a
    # loaded machine's seconds) put after it.
    end_s = rank_0_end_s(tmp_path / "j.db")
    assert 0 < first["at_s"] <= end_s and end_s - first["at_s"] < 20, (first, end_s)
    shown = run_cli("replay", ["show", "latest", "j.db", "--rank", "1"], cwd=tmp_path).stdout
    (line,) = [x for x in shown.splitlines() if "against rank 0's" in x]
    measured = float(line.split()[1])
    assert abs(measured - skew) < 0.5, line
    spans = [x.split() for x in shown.splitlines() if x.strip().startswith("+")]
    starts = [float(fields[0]) for fields in spans if len(fields) > 2 and fields[1] != "collective"]
    assert all(0 <= s <= end_s + 1 for s in starts), shown  # its start and rendezvous moved too


def rank_0_end_s(db: Path) -> float:
    """When rank 0's last event was journaled, in seconds since the run was created."""
    journal = Journal.open_for_read(str(db))
    try:
        (run,) = journal.runs()
        last = max(e.wall_time for e in journal.read(run_id=run.run_id) if e.rank == 0)
        return last - run.created_at
    finally:
        journal.close()


@pytest.mark.parametrize(
    ("skew", "said"),
    [
        ("1:-1e12", "'-1e12' is not a number of seconds in -86400..86400 (a day)"),
        ("1:nan", "'nan' is not a number of seconds in -86400..86400 (a day)"),
        ("1:inf", "'inf' is not a number of seconds in -86400..86400 (a day)"),
        ("1:soon", "'soon' is not a number of seconds in -86400..86400 (a day)"),
        ("2:30", "rank 2 is outside 0..1"),
        ("1=30", "'1=30' is not RANK:SECONDS"),
        ("1:30,", "'' is not RANK:SECONDS"),
        ("1:30,1:40", "rank 1 is named twice"),
    ],
    ids=["a-day-exceeded", "nan", "inf", "not-a-number", "no-such-rank", "no-colon",
         "empty-entry", "rank-twice"],
)  # fmt: skip
def test_a_clock_skew_that_cannot_be_right_is_one_line_and_exit_2(
    tmp_path: Path, skew: str, said: str
) -> None:
    """Every entry of LIFECYCLE_CLOCK_SKEW must be a rank of the world and a finite number of
    seconds within a day: anything else is one line naming the variable, and exit 2 before
    any rank starts, rather than ignored or taken."""
    done = run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--num-ranks", "2", "--db", "j.db"],
        cwd=tmp_path, timeout=180, env={"LIFECYCLE_CLOCK_SKEW": skew},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert one_clear_line(done) == f"lifecycle: error: LIFECYCLE_CLOCK_SKEW={skew!r}: {said}"
    assert list(tmp_path.iterdir()) == []
