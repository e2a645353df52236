"""Journals for the replay tests: real runs (one and two ranks) and a fault matrix."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lifecycle.store.journal import Journal
from tests.replay.fault_matrix import Produced, produce


@dataclass(frozen=True)
class Journaled:
    db: Path
    run_ids: tuple[str, ...]


def boot(db: Path, *args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run(
        [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video", "--db", str(db),
         "--log-level", "error", *args],
        cwd=db.parent, capture_output=True, timeout=180, check=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )  # fmt: skip


def run_ids(db: Path) -> tuple[str, ...]:
    journal = Journal.open_for_read(str(db))
    try:
        return tuple(r.run_id for r in journal.runs())
    finally:
        journal.close()


@pytest.fixture(scope="session")
def bounded_and_calibrated(tmp_path_factory: pytest.TempPathFactory) -> Journaled:
    """One journal holding a bounded run (auto residency disabled) and then a calibrated one."""
    db = tmp_path_factory.mktemp("single") / "j.db"
    boot(db, env={"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1"})
    boot(db, "--calibrate")
    return Journaled(db=db, run_ids=run_ids(db))


@pytest.fixture(scope="session")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Journaled:
    """A calibrated 2-rank run that reached ready, heartbeating often enough that even a
    startup of a second on a quiet machine journals heartbeats."""
    db = tmp_path_factory.mktemp("two") / "j.db"
    boot(db, "--num-ranks", "2", "--calibrate", "--heartbeat-interval", "0.1")
    return Journaled(db=db, run_ids=run_ids(db))


@pytest.fixture(scope="session")
def fault_matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Produced]:
    return produce(tmp_path_factory.mktemp("faults"))


def copy_journal(source: Path, destination: Path) -> None:
    """A consistent copy of a SQLite journal, what its WAL holds included (copying the file
    alone loses the events a writer's WAL has not checkpointed yet)."""
    with (
        sqlite3.connect(f"file:{source}?mode=ro", uri=True) as src,
        sqlite3.connect(destination) as dst,
    ):
        src.backup(dst)
    dst.close()
    src.close()
