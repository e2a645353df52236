"""The boots and journals the history benchmarks (bench/history.py, bench/historyidle.py) run
and read: `lifecycle boot` on the bounded path in a child process, and the journal's rows."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.calibration import BOUNDED_ENV
from bench.suite import BenchError

MODEL = "micro-video"
BOOT_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 240.0
# A boot on the bounded path with calibration closed: the same path, and so the same history
# key, every time, whatever a loaded machine makes of a residency plan's verification.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", **BOUNDED_ENV}


def boot(db: Path, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "lifecycle", "boot", "--model", MODEL, "--db", str(db),
               "--log-level", "warning", *extra]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            command, cwd=db.parent, env=ENV, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        code = proc.wait(timeout=BOOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill(proc)
        raise BenchError(f"a boot did not finish in {BOOT_TIMEOUT_S:.0f} s") from None
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise BenchError(f"a healthy boot exited {code}: {' '.join(tail)[:300]}")


def kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def query(db: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Rows of `sql` from the SQLite journal `db`, read-only."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def run_ids(db: Path) -> list[str]:
    if not db.exists():
        return []
    return [str(r) for (r,) in query(db, "SELECT run_id FROM runs ORDER BY created_at")]
