"""Bad journals: one line or one warning each, never a traceback; good journals still read."""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lifecycle.testing.journals import JournalBuilder, a2a, beat
from replay.cli import main
from tests.conftest import Completed, run_cli


def replay_cli(cwd: Path, *args: str) -> Completed:
    return run_cli("replay", args, cwd=cwd, timeout=60)


def no_traceback(result: Completed) -> list[str]:
    """stderr, which must be lines replay wrote itself."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("replay: ") for line in lines), result.stderr
    return lines


def good_journal(path: Path, run_id: str = "run-good") -> Path:
    b = JournalBuilder(path, run_id=run_id, world_size=1)
    b.rank(0).walk(0.1, "gate-check", "bounded-warm")
    b.rank(0).add(1.0, a2a("world", 0, ranks=(0,), splits=(8,)))
    for t in range(2, 6):
        b.rank(0).add(t, beat())
    b.close()
    return path


def edited(path: Path, *statements: str, run_id: str = "run-bad") -> Path:
    """A good journal of its own run, then changed by SQL, with nothing left in a -wal file."""
    good_journal(path, run_id=run_id)
    conn = sqlite3.connect(path)
    for statement in statements:
        conn.execute(statement)
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("PRAGMA journal_mode=DELETE")
    conn.close()
    return path


def garbage_pages(path: Path) -> Path:
    """A valid SQLite header over pages of garbage."""
    edited(path)
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for i in range(page, len(data)):
        data[i] = (i * 7 + 3) % 256
    path.write_bytes(bytes(data))
    return path


DEEP = "[" * 100_000 + "]" * 100_000
BAD_JOURNALS: dict[str, Callable[[Path], object]] = {
    "garbage pages under a valid header": garbage_pages,
    "an event payload stored as a BLOB": lambda p: edited(
        p, "UPDATE events SET data = X'00FF7B7D' WHERE seq = 3"
    ),
    "an event payload nested past the recursion limit": lambda p: edited(
        p, f"UPDATE events SET data = '{DEEP}' WHERE seq = 3"
    ),
    "a run row with text for numbers": lambda p: edited(
        p, "UPDATE runs SET world_size = 'two', created_at = 'yesterday'"
    ),
    "a config nested past the recursion limit": lambda p: edited(
        p, f"""UPDATE runs SET config = '{{"model": {DEEP}}}'"""
    ),
    "a directory": lambda p: p.mkdir(),
    "a FIFO": os.mkfifo,
}


@pytest.mark.parametrize("kind", list(BAD_JOURNALS))
def test_one_bad_journal_among_good_ones_is_a_warning(tmp_path: Path, kind: str) -> None:
    """Given beside a good journal, in either order, a bad one is a warning line and the good
    run is still listed and diagnosed."""
    good_journal(tmp_path / "good.db")
    BAD_JOURNALS[kind](tmp_path / "bad.db")
    for order in (("good.db", "bad.db"), ("bad.db", "good.db")):
        listed = replay_cli(tmp_path, "runs", *order, "--json")
        assert listed.returncode == 0, listed.stderr
        assert "run-good" in [r["run_id"] for r in json.loads(listed.stdout)]
        assert no_traceback(listed), "the bad journal is not mentioned"
        diagnosed = replay_cli(tmp_path, "diagnose", "run-good", *order, "--json")
        no_traceback(diagnosed)
        assert json.loads(diagnosed.stdout)["run_id"] == "run-good"


CONFIGS: dict[str, dict[str, Any]] = {
    "model is a string": {"model": "x"},
    "model name is a number": {"model": {"name": 5}},
    "model is null": {"model": None},
    "numbers are lists": {"heartbeat_interval_s": [1, 2], "state_deadline_s": {"s": 1}},
    "numbers are not positive": {"heartbeat_interval_s": -1, "dist_timeout_s": 0},
    "flags are odd": {"calibrate": [], "performance_mode": {"a": 1}},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_config_of_the_wrong_shape_is_shown_not_a_traceback(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose recorded config has fields of the wrong shape: `show` prints the run (the
    model as '?' where it has no name) and every command answers without a traceback."""
    db = tmp_path / "j.db"
    good_journal(db)
    conn = sqlite3.connect(db)
    (config,) = conn.execute("SELECT config FROM runs").fetchone()
    conn.execute(
        "UPDATE runs SET config = ?", (json.dumps({**json.loads(config), **CONFIGS[name]}),)
    )
    conn.commit()
    conn.close()
    shown = replay_cli(tmp_path, "show", "latest", "j.db")
    no_traceback(shown)
    assert shown.returncode == 0
    assert shown.stdout.startswith("run run-good")
    if name.startswith("model"):
        assert "  model ?" in shown.stdout.splitlines()[0]
    monkeypatch.chdir(tmp_path)
    for argv in COMMANDS:
        answered_in_process(argv("j.db"), capsys)


def answered_in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """`replay ARGV...` through the CLI's entry point: an exit status it chose (an exception
    escaping it is what a user would see as a traceback), and only its own lines on stderr."""
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert all(line.startswith("replay: ") for line in lines), err
    assert status in (0, 1, 2, 3), err
    if status == 2:
        assert len(lines) == 1 and lines[0].startswith("replay: error: "), err


COMMANDS: list[Callable[[str], list[str]]] = [
    lambda j: ["runs", j],
    lambda j: ["runs", j, "--json"],
    lambda j: ["show", "latest", j],
    lambda j: ["show", "latest", j, "--json"],
    lambda j: ["show", "latest", j, "--at", "1.5"],
    lambda j: ["diagnose", "latest", j],
    lambda j: ["diagnose", "latest", j, "--json"],
    lambda j: ["verify", "--all", j],
    lambda j: ["verify", "latest", j, "--json"],
    lambda j: ["trace", "latest", j, "-o", "out.json"],
    lambda j: ["diff", "latest", "latest", j],
]


@pytest.mark.parametrize(
    "kind", [*BAD_JOURNALS, "a URL of no known database", "a file path with odd characters"]
)
def test_every_command_answers_a_bad_journal_without_a_traceback(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each replay command given only a bad journal: an answer or one clear error line (exit
    2), never a traceback."""
    monkeypatch.chdir(tmp_path)
    if kind == "a URL of no known database":
        journal = "nosuchdb://host/db"
    elif kind == "a file path with odd characters":
        journal = "odd ?#%\x1b[31m.db"
        good_journal(tmp_path / journal)
    else:
        journal = "bad.db"
        BAD_JOURNALS[kind](tmp_path / journal)
    for argv in COMMANDS:
        answered_in_process(argv(journal), capsys)
