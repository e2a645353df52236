"""Flight Recorder dumps made to hurt the reader, dropped where `replay` finds them by itself:
the folder a run's ranks journaled dumping to. Each is one warning line, the verdict is given
without it, and nothing it holds reaches the terminal or a path."""

from __future__ import annotations

import json
import os
import pickle
import resource
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.format.events import FlightRecorderDumped
from lifecycle.core.format.records import TorchGroup
from lifecycle.testing.journals import AS_WRITTEN, T0, JournalBuilder
from tests.conftest import REPO, Completed

RUN_ID = "run-hand-built"
# Enough for replay to read a small journal; a reader that copies what a dump shares runs
# out of it long before the machine does.
ADDRESS_SPACE = 3 << 30


@dataclass(frozen=True)
class DumpedRun:
    db: Path
    folder: Path  # where the run's ranks journaled their dumps


def entry(*, op: str = "gloo:all_reduce", pg: str = "default_pg", file: str = "pipe.py",
          function: str = "denoise", record_id: int = 0) -> dict[str, Any]:  # fmt: skip
    """One Flight Recorder entry, as torch writes it."""
    return {
        "record_id": record_id, "process_group": ("0", pg), "collective_seq_id": record_id + 1,
        "p2p_seq_id": 0, "is_p2p": False, "profiling_name": op, "input_sizes": [[8]],
        "output_sizes": [[8]], "input_dtypes": ["Float"], "state": "scheduled",
        "time_created_ns": int((T0 + 1.0) * 1e9), "retired": False, "timeout_ms": 600_000,
        "frames": [{"filename": file, "line": 53, "name": function}],
    }  # fmt: skip


def dump(*entries: dict[str, Any]) -> bytes:
    return pickle.dumps({"version": "2.10", "pg_config": {}, "entries": list(entries)})


def dumped_run(tmp_path: Path, *, run_id: str = RUN_ID) -> DumpedRun:
    """Two ranks in bounded-warm that each journaled dumping its Flight Recorder into the
    run's folder; rank 0's dump is there and good, rank 1's is for the test to write."""
    db = tmp_path / "lifecycle.db"
    folder = tmp_path / "lifecycle.db.flight-recorder" / run_id
    folder.mkdir(parents=True)
    (folder / "fr_trace_rank_0").write_bytes(dump(entry()))
    builder = JournalBuilder(db, run_id=run_id)
    for rank in (0, 1):
        builder.rank(rank).walk(0.1, "gate-check", "bounded-warm")
        builder.rank(rank).add(
            2.0,
            FlightRecorderDumped(
                reason="stall", path=str(folder / f"fr_trace_rank_{rank}"), host="builder",
                bytes=1, entries=1, groups=(TorchGroup(group="world", torch_name="0"),),
            ),
        )  # fmt: skip
    builder.close()
    return DumpedRun(db=db, folder=folder)


def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def replay(cwd: Path, *args: str) -> Completed:
    """`replay ARGS` as a real process, in a bounded address space and time."""
    proc = subprocess.run(
        [sys.executable, "-m", "replay", *args],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
        capture_output=True, text=True, timeout=120, check=False, preexec_fn=_bounded,
    )  # fmt: skip
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def argv(command: str, run: DumpedRun) -> list[str]:
    given = {"diagnose": AS_WRITTEN, "trace": ("-o", str(run.db.parent / "t.json"))}
    return [command, "latest", str(run.db), *given.get(command, ())]


def warned_once(result: Completed, name: str) -> str:
    """The one warning line about dump `name`, with no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if name in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("replay: warning: flight recorder: "), lines[0]
    return lines[0]


def nested_tuple_key(depth: int) -> bytes:
    """A dump whose dict has a key of `depth` nested tuples: 2 bytes a level."""
    # Inside the dict's own SETITEMS: EMPTY_TUPLE and a TUPLE1 a level, then its value, None.
    items = pickle.dumps({"version": "2.10", "entries": []}, protocol=2)[: -len(b"u.")]
    return items + b")" + b"\x85" * depth + b"Nu."


DEEP = {
    "pickle": nested_tuple_key(200_000),
    "json": b'{"version": "2.10", "entries": ' + b"[" * 200_000 + b"]" * 200_000 + b"}",
}


@pytest.mark.parametrize("form", list(DEEP))
@pytest.mark.parametrize("command", ["diagnose", "show", "trace"])
def test_a_deeply_nested_dump_is_one_warning_and_the_verdict_goes_on(
    tmp_path: Path, command: str, form: str
) -> None:
    """A 400 KB dump nested 200,000 levels deep in the run's own folder, read with no flag:
    one warning line, the command's own exit status, rank 0's good dump still read."""
    run = dumped_run(tmp_path)
    (run.folder / "fr_trace_rank_1").write_bytes(DEEP[form])
    result = replay(tmp_path, *argv(command, run))
    assert result.returncode == (3 if command == "diagnose" else 0), result.stderr
    assert "nested deeper than 64 levels" in warned_once(result, "fr_trace_rank_1")
    if command == "show":
        assert "flight recorder (fr_trace_rank_0): 1 entries" in result.stdout


def test_a_dump_that_shares_one_long_string_everywhere_is_refused(tmp_path: Path) -> None:
    """A 1 MiB string shared through the pickle's memo by thousands of entries, as a frame's
    file name: refused by what it expands to, in one warning line, not copied into gigabytes."""
    run = dumped_run(tmp_path)
    shared = entry(file="x" * (1 << 20))
    (run.folder / "fr_trace_rank_1").write_bytes(dump(*[shared] * 4000))
    result = replay(tmp_path, *argv("diagnose", run), "--json")
    assert result.returncode == 3, result.stderr
    assert "expands to more than" in warned_once(result, "fr_trace_rank_1")
    assert json.loads(result.stdout)["flight_recorder"]["ranks"] == [0]


ESCAPES = "\x1b]0;owned\x07\x1b[2J\x1b[31m"


@pytest.mark.parametrize("command", ["diagnose", "show"])
def test_escape_sequences_in_a_dump_never_reach_the_terminal(tmp_path: Path, command: str) -> None:
    """A collective only rank 1's dump holds, whose op, process group, frame file and function
    carry escape sequences: what `diagnose` and `show` print of it holds none of them."""
    run = dumped_run(tmp_path)
    (run.folder / "fr_trace_rank_0").write_bytes(dump())
    hostile = entry(
        op=f"gloo:all_{ESCAPES}reduce", pg=f"pg{ESCAPES}x", file=f"evil{ESCAPES}.py",
        function=f"den{ESCAPES}oise",
    )  # fmt: skip
    (run.folder / "fr_trace_rank_1").write_bytes(dump(hostile))
    result = replay(tmp_path, *argv(command, run))
    assert "Traceback" not in result.stderr, result.stderr
    assert "all_0;ownedreduce #1 of pg0;ownedx" in result.stdout
    assert "evil0;owned.py:53 den0;ownedoise" in result.stdout
    assert not set("\x1b\x07") & set(result.stdout + result.stderr)


def test_a_run_id_that_is_a_path_is_never_joined_into_one(tmp_path: Path) -> None:
    """A journal whose run id is `../elsewhere`, read with --flight-recorder DIR: the dump
    outside DIR that the id points at is never read."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "fr_trace_rank_0").write_bytes(dump(entry(op="gloo:from_outside")))
    given = tmp_path / "given"
    given.mkdir()
    db = tmp_path / "odd.db"
    builder = JournalBuilder(db, world_size=1)
    builder.rank(0).walk(0.1, "gate-check", "bounded-warm")
    builder.close()
    with sqlite3.connect(db) as conn:  # as a journal from anywhere may hold it
        for table in ("runs", "events", "rank_summaries", "rank_checkpoints"):
            conn.execute(f"UPDATE {table} SET run_id = '../elsewhere'")
    result = replay(given, "show", "latest", str(db), "--flight-recorder", str(given))
    assert "Traceback" not in result.stderr, result.stderr
    assert "from_outside" not in result.stdout


@pytest.mark.parametrize("special", ["fifo", "device"])
def test_a_dump_that_is_not_a_regular_file_is_never_opened(tmp_path: Path, special: str) -> None:
    """A FIFO (no writer will ever come) or a link to /dev/zero (no end) named as rank 1's dump
    in its folder: one warning line, at once; the verdict is given without it."""
    run = dumped_run(tmp_path)
    target = run.folder / "fr_trace_rank_1"
    if special == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    result = replay(tmp_path, *argv("diagnose", run))
    assert result.returncode == 3, result.stderr
    assert "not a regular file" in warned_once(result, "fr_trace_rank_1")
