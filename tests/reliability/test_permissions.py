"""Journals behind file permissions: readers work where they may only read and leave nothing
that blocks a writer; what may not be read or written is refused in one line."""

from __future__ import annotations

import json
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import file_digest, one_clear_line, run_cli, run_unprivileged

MICRO = ["--model", "micro-video", "--log-level", "error"]


@pytest.fixture
def booted(tmp_path: Path) -> Iterator[Path]:
    """A journal holding one ready run; its directory's permissions restored afterwards."""
    db = tmp_path / "journals" / "j.db"
    db.parent.mkdir()
    result = run_cli("lifecycle", ["boot", *MICRO, "--db", str(db)], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    yield db
    db.parent.chmod(0o755)
    for path in db.parent.iterdir():
        path.chmod(0o644)


def listing(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


def test_replay_reads_a_journal_in_a_read_only_directory(tmp_path: Path, booted: Path) -> None:
    """A WAL journal in a 555 directory: `replay runs` lists its run, creates nothing there,
    and the journal's bytes do not change."""
    booted.parent.chmod(0o555)
    before, digest = listing(booted.parent), file_digest(booted)
    result = run_unprivileged(tmp_path, "replay", "runs", str(booted), "--json")
    assert result.returncode == 0, result.stderr
    assert [run["outcome"] for run in json.loads(result.stdout)] == ["ready"]
    assert listing(booted.parent) == before
    assert file_digest(booted) == digest


@pytest.mark.parametrize(
    "reader", ["unprivileged", pytest.param("privileged", marks=pytest.mark.slow)]
)
def test_reading_a_read_only_journal_leaves_nothing_that_blocks_a_later_writer(
    tmp_path: Path, booted: Path, reader: str
) -> None:
    """`replay runs` on a 444 journal, by a reader held to its permissions or by one that is
    not (root), leaves no -wal or -shm file behind; once the journal is writable again, a
    later `lifecycle boot --db` held to the permissions appends its run to it."""
    booted.chmod(0o444)
    if reader == "unprivileged":
        result = run_unprivileged(tmp_path, "replay", "runs", str(booted))
    else:
        result = run_cli("replay", ["runs", str(booted)], cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(listing(booted.parent)) == ["j.db"]
    booted.chmod(0o644)
    result = run_unprivileged(tmp_path, "lifecycle", "boot", *MICRO, "--db", str(booted))
    assert result.returncode == 0, result.stderr
    result = run_unprivileged(tmp_path, "replay", "runs", str(booted), "--json")
    assert [run["outcome"] for run in json.loads(result.stdout)] == ["ready", "ready"]


@pytest.mark.parametrize(
    "argv",
    [["replay", "runs", "J"], ["lifecycle", "boot", *MICRO, "--db", "J"]],
    ids=["replay", "boot"],
)
def test_a_journal_that_cannot_be_read_is_refused_in_one_line(
    tmp_path: Path, booted: Path, argv: list[str]
) -> None:
    """A 000 journal: exit 2, one line saying it cannot be read, the bytes unchanged."""
    booted.chmod(0o000)
    digest = file_digest(booted)
    module, *args = (str(booted) if a == "J" else a for a in argv)
    result = run_unprivileged(tmp_path, module, *args)
    assert result.returncode == 2
    assert one_clear_line(result).endswith(f"{booted}: cannot be read: permission denied")
    assert file_digest(booted) == digest


def test_boot_refuses_a_journal_it_may_not_write(tmp_path: Path, booted: Path) -> None:
    """A 444 journal: `lifecycle boot` exits 2 with one line before writing anything, and
    leaves no -wal or -shm file behind."""
    booted.chmod(0o444)
    digest = file_digest(booted)
    result = run_unprivileged(tmp_path, "lifecycle", "boot", *MICRO, "--db", str(booted))
    assert result.returncode == 2
    assert one_clear_line(result) == (
        f"lifecycle: error: {booted}: cannot be written: permission denied"
    )
    assert file_digest(booted) == digest
    assert sorted(listing(booted.parent)) == ["j.db"]
