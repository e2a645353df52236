"""The world of a run: ranks outside it, and journals that disagree on its size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lifecycle.core.format.events import Error, RunStarted, Shutdown
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder, RankStream
from tests.conftest import Completed, run_cli
from tests.replay.scenarios import walked_to_ready


def replay_cli(cwd: Path, *args: str) -> Completed:
    result = run_cli("replay", args, cwd=cwd, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def joined(stream: RankStream, world_size: int) -> None:
    stream.add(
        0.05,
        RunStarted(
            world_size=world_size, host="builder", pid=1000, lifecycle_version="0.1.0",
            torch_version=None, python_version="3", device="cpu", dist_backend="gloo",
        ),
    )  # fmt: skip


def ready_and_stopped(stream: RankStream, world_size: int) -> None:
    joined(stream, world_size)
    walked_to_ready(stream)
    stream.add(
        1.2, Shutdown(reason="boot complete", signal=None, events_written=7, journal_write_s=0.0)
    )
    stream.walk(1.3, "stopped")


def failing(stream: RankStream, world_size: int) -> None:
    joined(stream, world_size)
    stream.walk(0.1, "gate-check")
    stream.add(0.5, Error(error_type="OutOfMemoryError", error_kind="exception",
                          message="out of memory", traceback="", trigger=None,
                          fatal=True))  # fmt: skip
    stream.walk(0.6, "failed")


def warnings(result: Completed) -> list[str]:
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("replay: warning: ") for line in lines), result.stderr
    return lines


def test_events_of_a_rank_outside_the_world_are_set_aside(tmp_path: Path) -> None:
    """A run of 2 ranks, both ready, whose journal also holds a failing rank 3: the verdict is
    `ready` (exit 0) from ranks 0 and 1, a warning says rank 3 was set aside, and `show` does
    not list it."""
    b = JournalBuilder(tmp_path / "j.db", world_size=2)
    for rank in (0, 1):
        ready_and_stopped(b.rank(rank), 2)
    failing(b.rank(3), 2)
    b.close()
    result = replay_cli(tmp_path, "diagnose", "latest", "j.db", "--json", *AS_WRITTEN)
    doc = json.loads(result.stdout)
    assert (result.returncode, doc["outcome"]) == (0, "ready"), doc["summary"]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    (line,) = warnings(result)
    assert "events of rank 3 set aside: outside its world of 2 rank(s)" in line
    shown = replay_cli(tmp_path, "show", "latest", "j.db", "--json")
    assert [r["rank"] for r in json.loads(shown.stdout)["ranks"]] == [0, 1]


def test_a_world_size_the_files_disagree_on_gives_one_verdict_in_either_order(
    tmp_path: Path,
) -> None:
    """One file per rank, the second recording the run as 4 ranks wide and holding a failing
    rank 3 that claims a world of 4: in either order the world is the 2 ranks 0 and 1 joined
    (their run_started say so), the verdict is the same `ready`, and warnings say why."""
    a = JournalBuilder(tmp_path / "a.db", world_size=2)
    ready_and_stopped(a.rank(0), 2)
    a.close()
    b = JournalBuilder(tmp_path / "b.db", world_size=4)
    ready_and_stopped(b.rank(1), 2)
    failing(b.rank(3), 4)
    b.close()
    verdicts = []
    for order in (("a.db", "b.db"), ("b.db", "a.db")):
        result = replay_cli(tmp_path, "diagnose", "latest", *order, "--json", *AS_WRITTEN)
        doc = json.loads(result.stdout)
        assert (result.returncode, doc["outcome"]) == (0, "ready"), doc["summary"]
        lines = warnings(result)
        assert any("journals disagree on its world size" in line and "using 2" in line
                   for line in lines), lines  # fmt: skip
        assert any("events of rank 3 set aside" in line for line in lines), lines
        verdicts.append(doc)
    first, second = verdicts
    assert first == second
    assert first["missing_ranks"] == []
    assert [r["rank"] for r in first["ranks"]] == [0, 1]


def test_runs_lists_the_settled_world_size(tmp_path: Path) -> None:
    """`replay runs` shows the world size the ranks joined, not the first file's record."""
    a = JournalBuilder(tmp_path / "a.db", world_size=4)
    ready_and_stopped(a.rank(0), 2)
    a.close()
    b = JournalBuilder(tmp_path / "b.db", world_size=2)
    ready_and_stopped(b.rank(1), 2)
    b.close()
    result = replay_cli(tmp_path, "runs", "a.db", "b.db", "--json", *AS_WRITTEN)
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    assert [(r["world_size"], r["outcome"]) for r in rows] == [(2, "ready")]
