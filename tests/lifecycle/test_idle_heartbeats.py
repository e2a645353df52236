"""Heartbeats bounded after ready: a real `lifecycle serve` left idle journals no heartbeat
event, yet reads as alive wherever liveness is judged (replay, /metrics, /lifecycle), and a
rank killed while idle still reads as dead."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lifecycle.serve.ranks.supervisor import free_port
from tests.conftest import run_cli, wait_until

pytestmark = [pytest.mark.ranks]

READY_WITHIN_S = 240.0
IDLE_S = 4.0  # four heartbeat intervals (the default, 1 s)


@dataclass
class Idle:
    proc: subprocess.Popen[bytes]
    url: str
    db: Path

    def count(self, kind: str) -> int:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30) as conn:
            (n,) = conn.execute("SELECT COUNT(*) FROM events WHERE kind = ?", (kind,)).fetchone()
        return int(n)

    def rank_pid(self) -> int:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=30) as conn:
            (data,) = conn.execute("SELECT data FROM events WHERE kind = 'run_started'").fetchone()
        return int(json.loads(data)["pid"])

    def diagnose(self) -> dict[str, object]:
        done = run_cli("replay", ["diagnose", "latest", str(self.db), "--json"],
                       cwd=self.db.parent, timeout=60)  # fmt: skip
        doc: dict[str, object] = json.loads(done.stdout)
        return doc


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def start_idle(where: Path) -> Iterator[Idle]:
    """A one-rank server on micro-video, healthy and then left alone for IDLE_S."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with (where / "serve.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "serve", "--model", "micro-video", "--db", "j.db",
             "--port", str(port), "--log-level", "warning", "--smoke-request", "off"],
            cwd=where, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )  # fmt: skip
    try:
        wait_until(lambda: healthy(url), within=READY_WITHIN_S, what="/health 200")
        yield Idle(proc=proc, url=url, db=where / "j.db")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Idle]:
    with start_idle(tmp_path_factory.mktemp("idle")) as server:
        yield server


def test_an_idle_server_journals_no_heartbeat_event(idle: Idle) -> None:
    """Serving with nothing to do, a rank journals no heartbeat for several intervals, while
    its summary row's heartbeat stays within an interval or two of now."""
    time.sleep(2.0)  # the beat after the ready action journals its last marks
    before = idle.count("heartbeat")
    time.sleep(IDLE_S)
    assert idle.count("heartbeat") == before
    with sqlite3.connect(f"file:{idle.db}?mode=ro", uri=True, timeout=30) as conn:
        (beat,) = conn.execute("SELECT last_heartbeat_wall FROM rank_summaries").fetchone()
    assert time.time() - beat < 3.0


def test_an_idle_server_reads_as_ready_to_replay(idle: Idle) -> None:
    """`replay diagnose` judges an idle server ready, not crashed, though its last event is
    older than its heartbeat intervals allow."""
    time.sleep(IDLE_S)
    doc = idle.diagnose()
    assert doc["outcome"] == "ready", doc["summary"]
    (rank,) = doc["ranks"]  # type: ignore[misc]
    assert rank["status"] == "ready"
    assert rank["last_heartbeat_age_s"] < 3.0


def test_an_idle_server_shows_a_fresh_heartbeat_in_metrics_and_lifecycle(idle: Idle) -> None:
    """/metrics' heartbeat age and /lifecycle's stay within a few intervals while idle."""
    time.sleep(IDLE_S)
    metrics = httpx.get(f"{idle.url}/metrics", timeout=10).text
    (line,) = [m for m in metrics.splitlines() if m.startswith("lifecycle_heartbeat_age_seconds{")]
    assert float(line.split()[-1]) < 3.0
    (rank,) = httpx.get(f"{idle.url}/lifecycle", timeout=10).json()["ranks"]
    assert rank["last_heartbeat_age_s"] < 3.0
    assert rank["healthy"] is True


def test_a_rank_killed_while_idle_reads_as_crashed(tmp_path: Path) -> None:
    """A rank SIGKILLed while the server idles is crashed to `replay diagnose` a few
    heartbeat intervals later."""
    with start_idle(tmp_path) as server:
        time.sleep(2.0)
        os.kill(server.rank_pid(), signal.SIGKILL)
        time.sleep(IDLE_S)
        doc = server.diagnose()
        assert doc["outcome"] == "crashed", doc["summary"]
        (rank,) = doc["ranks"]  # type: ignore[misc]
        assert rank["status"] == "crashed"
