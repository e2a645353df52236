"""`replay diagnose` on real startups caught in the act: running, stopped, or a rank just dead."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from lifecycle.core.settings.modelspec import MODEL_PRESETS
from tests.conftest import REPO, Completed, run_cli, wait_until

if TYPE_CHECKING:
    from lifecycle.core.settings.modelspec import ModelSpec
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline import Pipeline

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

# Rank processes import this module for `--pipeline`, so it must be importable from the repo.
ENV = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
FAST = ("--model", "micro-video", "--heartbeat-interval", "0.2", "--log-level", "error")
BUSY_SPEC = dataclasses.replace(MODEL_PRESETS["micro-video"], name="busy-video")
BUSY_ROUNDS = 5000


def busy_factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    """micro-video whose denoising runs over and over (real work, real collectives, the same
    count on every rank) until the startup is stopped: bounded-warm that lasts."""
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    class Busy(TinyVideoPipeline):
        def denoise(self, *args: Any, **kwargs: Any) -> Any:
            for _ in range(BUSY_ROUNDS):
                latents = super().denoise(*args, **kwargs)
            return latents

    return Busy(BUSY_SPEC, comm=comm)


BUSY = (BUSY_SPEC, busy_factory)


def diagnose(cwd: Path, db: Path) -> tuple[Completed, dict[str, Any]]:
    result = run_cli("replay", ["diagnose", "latest", str(db), "--json"], cwd=cwd, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result, json.loads(result.stdout)


def count(db: Path, sql: str) -> int:
    """One number from the journal, read-only; 0 while it has no tables yet."""
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return int(conn.execute(sql).fetchone()[0])
    except sqlite3.Error:
        return 0


def rank_pids(db: Path) -> dict[int, int]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
        rows = conn.execute("SELECT rank, data FROM events WHERE kind = 'run_started'")
        return {int(rank): int(json.loads(data)["pid"]) for rank, data in rows}


@contextmanager
def started(cwd: Path, *argv: str) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m lifecycle ARGV...` in the background, ended whatever happens."""
    with (cwd / "lifecycle.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", *argv], cwd=cwd, stdout=log,
            stderr=subprocess.STDOUT, env={**os.environ, **ENV},
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.slow
def test_a_startup_in_progress_is_running_and_after_sigterm_stopped(tmp_path: Path) -> None:
    """Diagnosed again and again while both ranks warm up, a healthy startup is `running`
    (exit 3, no culprit, never hung); after SIGTERM it is `stopped`, with the signal and the
    state of each rank, and still no culprit."""
    db = tmp_path / "j.db"
    argv = ["boot", *FAST, "--pipeline", f"{__name__}:BUSY", "--model", "busy-video",
            "--num-ranks", "2", "--dist-timeout", "60", "--db", str(db)]  # fmt: skip
    with started(tmp_path, *argv) as boot:
        warming = (
            "SELECT count(DISTINCT rank) FROM events"
            " WHERE state = 'bounded-warm' AND kind = 'collective_started'"
        )
        wait_until(lambda: count(db, warming) == 2, within=120, what="both ranks warming up")
        seen = []
        for _ in range(8):
            result, doc = diagnose(tmp_path, db)
            seen.append((result.returncode, doc["outcome"], tuple(doc["culprit_ranks"])))
            assert doc["outcome"] == "running", doc["summary"]
        assert set(seen) == {(3, "running", ())}
        moved_on = "SELECT count(*) FROM events WHERE state NOT IN ('created', 'gate-check',"
        assert count(db, moved_on + " 'bounded-warm')") == 0
        boot.send_signal(signal.SIGTERM)
        assert boot.wait(timeout=60) != 0
    result, doc = diagnose(tmp_path, db)
    assert (result.returncode, doc["outcome"], doc["culprit_ranks"]) == (3, "stopped", [])
    for rank in doc["ranks"]:
        assert (rank["status"], rank["last_state"], rank["stop_signal"]) == (
            "stopped", "bounded-warm", "SIGTERM"
        )  # fmt: skip
    assert "rank 0 by SIGTERM in bounded-warm, rank 1 by SIGTERM in bounded-warm" in doc["summary"]


def test_a_rank_that_exited_is_crashed_at_once(tmp_path: Path) -> None:
    """A rank that exits in bounded-warm is `crashed` as soon as its process is gone, long
    before its silence alone (three 10 s heartbeat intervals) would tell."""
    db = tmp_path / "j.db"
    boot = run_cli(
        "lifecycle",
        ["boot", *FAST, "--heartbeat-interval", "10", "--fault", "0:bounded-warm:exit",
         "--db", str(db)],
        cwd=tmp_path, timeout=120, env=ENV,
    )  # fmt: skip
    assert boot.returncode != 0
    result, doc = diagnose(tmp_path, db)
    assert (result.returncode, doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        1, "crashed", [0], "bounded-warm"
    )  # fmt: skip
    assert "is gone" in doc["ranks"][0]["note"]


@pytest.mark.slow
def test_a_rank_killed_after_ready_is_crashed_not_ready(tmp_path: Path) -> None:
    """SIGKILL of rank 1 of a serving 2-rank server: diagnose says `crashed`, rank 1, in
    ready, exit 1, and not `ready`."""
    from lifecycle.serve.ranks.supervisor import free_port

    db = tmp_path / "j.db"
    port = free_port()
    argv = ["serve", *FAST, "--num-ranks", "2", "--db", str(db), "--port", str(port)]
    with started(tmp_path, *argv), httpx.Client(timeout=10) as client:

        def healthy() -> bool:
            try:
                return client.get(f"http://127.0.0.1:{port}/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, within=120, what="/health 200")
        os.kill(rank_pids(db)[1], signal.SIGKILL)
        result, doc = diagnose(tmp_path, db)
    assert (result.returncode, doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        1, "crashed", [1], "ready"
    ), doc["summary"]  # fmt: skip
    ranks = {r["rank"]: r for r in doc["ranks"]}
    assert ranks[1]["status"] == "crashed"
