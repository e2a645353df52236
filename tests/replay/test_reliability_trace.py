"""`replay trace -o`: never writes over a journal it reads, nor anything but a regular file."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from pathlib import Path

import pytest

from lifecycle.testing.journals import JournalBuilder
from tests.conftest import Completed, file_digest, one_clear_line, run_cli, run_unprivileged


def replay_cli(cwd: Path, *args: str) -> Completed:
    return run_cli("replay", args, cwd=cwd, timeout=60)


def one_error_line(result: Completed) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    return one_clear_line(result)


def make_journal(path: Path) -> Path:
    b = JournalBuilder(path, world_size=1)
    b.rank(0).walk(0.1, "gate-check", "bounded-warm")
    b.close()
    return path


def spell(kind: str, directory: Path) -> tuple[str, str]:
    """(journal, -o) naming the same file differently, relative to `directory`."""
    if kind == "absolute URL":
        return f"sqlite:///{directory / 'j.db'}", str(directory / "j.db")
    if kind == "relative URL":
        return "sqlite:///j.db", "j.db"
    if kind == "URL with a driver":
        return f"sqlite+pysqlite:///{directory / 'j.db'}", "./j.db"
    if kind == "symlink read, file written":
        os.symlink("j.db", directory / "link.db")
        return "link.db", "j.db"
    if kind == "file read, symlink written":
        os.symlink("j.db", directory / "link.db")
        return "j.db", "link.db"
    if kind == "hard link written":
        os.link(directory / "j.db", directory / "hard.db")
        return "j.db", "hard.db"
    assert kind == "dot segments"
    return "j.db", f"../{directory.name}/./j.db"


@pytest.mark.parametrize(
    "kind",
    [
        "absolute URL",
        "relative URL",
        "URL with a driver",
        "symlink read, file written",
        "file read, symlink written",
        "hard link written",
        "dot segments",
    ],
)
def test_trace_refuses_any_name_of_a_journal_it_reads(tmp_path: Path, kind: str) -> None:
    """-o naming a journal being read, through a URL, a link or another path: exit 2 in one
    line, and the journal's bytes are what they were."""
    db = make_journal(tmp_path / "j.db")
    before = file_digest(db)
    journal, output = spell(kind, tmp_path)
    result = replay_cli(tmp_path, "trace", "latest", journal, "-o", output)
    assert "is one of the journals being read" in one_error_line(result)
    assert file_digest(db) == before
    assert not (tmp_path / "link.db").exists() or (tmp_path / "link.db").is_symlink()


def test_trace_refuses_the_write_ahead_log_of_a_journal_it_reads(tmp_path: Path) -> None:
    """-o naming the -wal file beside a journal that a writer holds open is refused; the log
    keeps its bytes."""
    db = make_journal(tmp_path / "j.db")
    writer = sqlite3.connect(db)
    try:
        writer.execute("PRAGMA journal_mode=WAL")
        writer.execute("CREATE TABLE keep_the_log_open (x)")
        wal = tmp_path / "j.db-wal"
        assert wal.exists()
        before = file_digest(wal)
        result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", "j.db-wal")
        assert "is one of the journals being read" in one_error_line(result)
        assert file_digest(wal) == before
    finally:
        writer.close()


def test_trace_refuses_a_sidecar_name_that_does_not_exist_yet(tmp_path: Path) -> None:
    """-o naming the -wal or -shm of a journal read through a link, while no such file
    exists: refused in one line, and nothing is created under that name."""
    make_journal(tmp_path / "j.db")
    os.symlink("j.db", tmp_path / "link.db")
    for sidecar in ("j.db-wal", "j.db-shm", "link.db-wal"):
        (tmp_path / sidecar).unlink(missing_ok=True)
        result = replay_cli(tmp_path, "trace", "latest", "link.db", "-o", sidecar)
        assert "is a file of a journal being read" in one_error_line(result)
        assert not (tmp_path / sidecar).is_file() or not (
            tmp_path / sidecar
        ).read_bytes().startswith(b"{")


def test_trace_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    """A directory, a FIFO, a character device, and a link to any of them: exit 2 in one line,
    and each is left what it was (no link replaced by a file, no FIFO opened)."""
    make_journal(tmp_path / "j.db")
    (tmp_path / "a-directory").mkdir()
    os.mkfifo(tmp_path / "a-fifo")
    os.symlink("/dev/null", tmp_path / "to-a-device")
    os.symlink("a-fifo", tmp_path / "to-a-fifo")
    os.symlink("a-directory", tmp_path / "to-a-directory")
    for name, kind in [
        ("a-directory", "a directory"),
        ("a-fifo", "a FIFO"),
        ("to-a-device", "a character device"),
        ("to-a-fifo", "a FIFO"),
        ("to-a-directory", "a directory"),
        ("/dev/null", "a character device"),
    ]:
        result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", name)
        assert f"is {kind}" in one_error_line(result), name
    assert stat.S_ISFIFO((tmp_path / "a-fifo").lstat().st_mode)
    for link in ("to-a-device", "to-a-fifo", "to-a-directory"):
        assert (tmp_path / link).is_symlink()
    assert list((tmp_path / "a-directory").iterdir()) == []
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_trace_to_a_directory_that_does_not_exist_is_one_line(tmp_path: Path) -> None:
    """-o in a missing directory, or one nothing can be created in: exit 2, one line."""
    make_journal(tmp_path / "j.db")
    result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", "nowhere/t.json")
    assert "does not exist" in one_error_line(result)
    result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", "/proc/t.json")
    assert "cannot be written" in one_error_line(result)
    assert not (tmp_path / "nowhere").exists()


def test_trace_into_a_read_only_directory_is_one_line(tmp_path: Path) -> None:
    """-o in a directory without write permission: exit 2, one line, nothing left there."""
    make_journal(tmp_path / "j.db")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = run_unprivileged(
            tmp_path, "replay", "trace", "latest", "j.db", "-o", "locked/t.json"
        )
        assert "cannot be written" in one_error_line(result)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o755)


def test_trace_dash_writes_the_trace_to_stdout(tmp_path: Path) -> None:
    """-o - prints the trace JSON on stdout and creates no file named '-'."""
    make_journal(tmp_path / "j.db")
    result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", "-")
    assert result.returncode == 0, result.stderr
    trace = json.loads(result.stdout)
    assert trace["otherData"]["run_id"] == "run-hand-built"
    assert not (tmp_path / "-").exists()


def test_trace_replaces_a_regular_file_whole_and_leaves_nothing_beside_it(
    tmp_path: Path,
) -> None:
    """An existing trace file (reached through a link) is replaced by the new trace, keeps its
    permissions and its link, and no temporary file is left beside it."""
    make_journal(tmp_path / "j.db")
    traces = tmp_path / "traces"
    traces.mkdir()
    old = traces / "t.json"
    old.write_text("old contents")
    old.chmod(0o640)
    os.symlink("t.json", traces / "latest.json")
    result = replay_cli(tmp_path, "trace", "latest", "j.db", "-o", "traces/latest.json")
    assert result.returncode == 0, result.stderr
    assert json.loads(old.read_text())["otherData"]["run_id"] == "run-hand-built"
    assert stat.S_IMODE(old.stat().st_mode) == 0o640
    assert (traces / "latest.json").is_symlink()
    assert sorted(p.name for p in traces.iterdir()) == ["latest.json", "t.json"]
