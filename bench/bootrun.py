"""`lifecycle boot` as a child process of a benchmark, and its startup as `replay show --json`
reads it back from the journal: each rank's path, its startup to ready and what no phase of it
holds."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.suite import BenchError

REPO = Path(__file__).resolve().parent.parent
REPLAY_TIMEOUT_S = 120.0
# Nothing reaches a model hub, and the children's warnings stay out of the figures' way.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStartup:
    """One rank's startup as replay show --json gives it."""

    rank: int
    path: tuple[str, ...]
    total_s: float
    unattributed_s: float
    phases: tuple[tuple[str, float], ...]

    @property
    def share(self) -> float:
        return self.unattributed_s / self.total_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Booted:
    """One boot: its run, each rank's startup, and the boot's own output."""

    run_id: str
    ranks: tuple[RankStartup, ...]
    stderr: str
    wall_s: float  # the boot process's start to its exit, as the parent timed it

    @property
    def ready_s(self) -> float:
        """Startup to ready: the launch to the last rank's ready."""
        return max(r.total_s for r in self.ranks)

    @property
    def path(self) -> tuple[str, ...]:
        return self.ranks[0].path


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The parent's environment less every OTEL_* variable, with BASE_ENV and `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {**env, **BASE_ENV, **(extra or {})}


def run_ids(db: Path) -> set[str]:
    if not db.exists():
        return set()
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(str(db)) as journal:
        return {run.run_id for run in journal.runs()}


def copy_journal(source: Path, target: Path) -> None:
    """A consistent copy of a SQLite journal (its write-ahead log included), by SQLite's own
    backup."""
    with (
        contextlib.closing(sqlite3.connect(source)) as src,
        contextlib.closing(sqlite3.connect(target)) as dst,
    ):
        src.backup(dst)


def run_to_exit(
    command: Sequence[str], *, cwd: Path, env: Mapping[str, str], timeout_s: float, ranks: int
) -> tuple[str, str]:
    """`command`, a `python -m lifecycle boot` of `ranks` ranks, to its exit: its stdout and
    stderr. BenchError if it overran `timeout_s` (ended with its rank processes) or exited
    other than 0 (with each rank's summary line and stderr's last lines)."""
    # A session of its own, so that a boot that overruns is ended with its rank processes.
    proc = subprocess.Popen(
        command, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10.0)
        raise BenchError(f"`{' '.join(command[3:])}` did not finish in {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        # Every rank's summary line, and what went to stderr: which rank did not get there.
        said = [*stdout.strip().splitlines()[-ranks:], *stderr.strip().splitlines()[-3:]]
        raise BenchError(
            f"`{' '.join(command[3:])}` exited {proc.returncode}: {' | '.join(said) or 'no output'}"
        )
    return stdout, stderr


def boot(
    args: Sequence[str], *, db: Path, cwd: Path, env: Mapping[str, str], timeout_s: float,
    ranks: int,
) -> Booted:  # fmt: skip
    """`python -m lifecycle boot ARGS --db DB` to its exit (ended with its ranks after
    `timeout_s`), and its new run read back; BenchError unless every rank got to ready."""
    before = run_ids(db)
    command = [sys.executable, "-m", "lifecycle", "boot", *args, "--db", str(db)]
    started = time.perf_counter()
    _, stderr = run_to_exit(command, cwd=cwd, env=env, timeout_s=timeout_s, ranks=ranks)
    wall_s = time.perf_counter() - started
    new = run_ids(db) - before
    if len(new) != 1:
        raise BenchError(f"expected one new run in {db}, found {len(new)}")
    (run_id,) = new
    startups = show(db, run_id, cwd=cwd, env=env)
    if len(startups) != ranks:
        raise BenchError(f"run {run_id} shows {len(startups)} ranks, expected {ranks}")
    return Booted(run_id=run_id, ranks=startups, stderr=stderr, wall_s=wall_s)


def show(db: Path, run_id: str, *, cwd: Path, env: Mapping[str, str]) -> tuple[RankStartup, ...]:
    """Each rank's startup from `replay show RUN DB --json`; BenchError for a rank that did not
    get to ready or has no account."""
    command = [sys.executable, "-m", "replay", "show", run_id, str(db), "--json"]
    done = subprocess.run(
        command, cwd=cwd, env=dict(env), capture_output=True, text=True,
        timeout=REPLAY_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"replay show {run_id} exited {done.returncode}: {done.stderr[-300:]}")
    ranks = json.loads(done.stdout)["ranks"]
    return tuple(_rank(run_id, doc) for doc in ranks)


def _rank(run_id: str, doc: dict[str, Any]) -> RankStartup:
    startup = doc.get("startup")
    if not isinstance(startup, dict) or not startup.get("ready"):
        raise BenchError(f"run {run_id} rank {doc.get('rank')}: no startup to ready accounted")
    return RankStartup(
        rank=int(doc["rank"]),
        path=tuple(doc["path"]),
        total_s=float(startup["total_s"]),
        unattributed_s=float(startup["unattributed_s"]),
        phases=tuple((p["name"], float(p["seconds"])) for p in startup["phases"]),
    )
