"""A server with the host's keeper (docs/keeper.md): a group killed with SIGKILL and started
again attaches, verifies and answers bit for bit as before; POST /sleep and /wake move every
rank through asleep and waking, journaled, with the refusals the states call for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.core.format.events import (
    ReferenceOutput,
    Transition,
    WeightsKept,
    WeightsPath,
    WeightsReleased,
)
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.store.journal import Journal
from tests.conftest import run_cli
from tests.support.keeper import key_env, running_keeper

SMALL = {"prompt": "a fox in snow", "width": 128, "height": 128, "frames": 5, "steps": 2}


@contextmanager
def serving(tmp_path: Path, env: dict[str, str], *extra: str) -> Iterator[httpx.Client]:
    """`lifecycle serve --model micro-video` in a session of its own (SIGKILL reaches its
    ranks too), ready; killed on the way out if it still runs."""
    port = free_port()
    with (tmp_path / "serve.log").open("a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "serve", "--model", "micro-video", "--db", "j.db",
             "--port", str(port), "--log-level", "warning", "--smoke-request", "off", *extra],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0)
    client.proc = proc  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve never became ready"
            time.sleep(0.2)
        yield client
    finally:
        client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def _npy(client: httpx.Client, body: dict[str, object]) -> bytes:
    reply = client.post("/generate", json={**body, "response_format": "npy"})
    assert reply.status_code == 200, reply.text
    return reply.content


def _runs(db: Path) -> list[dict[int, list[object]]]:
    """Each run's events by rank, oldest run first."""
    journal = Journal.open_for_read(str(db))
    try:
        runs = sorted(journal.runs(), key=lambda r: r.created_at)
        found = []
        for run in runs:
            by_rank: dict[int, list[object]] = {}
            for stored in journal.read(run_id=run.run_id):
                by_rank.setdefault(stored.rank, []).append(stored.event)
            found.append(by_rank)
        return found
    finally:
        journal.close()


def test_a_group_killed_and_started_again_attaches_and_answers_bit_for_bit(
    tmp_path: Path,
) -> None:
    """Two ranks SIGKILLed with their server, then started again: every rank attaches to the
    keeper's weights, matches the reference before ready, and the same request's video is the
    same bytes; at the cold start one rank gave the weights and the other packed nothing."""
    env = key_env()
    with running_keeper(tmp_path, env) as keeper:
        layout = ("--num-ranks", "2", "--keeper", str(keeper.socket))
        with serving(tmp_path, env, *layout) as first:
            before = _npy(first, SMALL)
            os.killpg(first.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
            first.proc.wait(timeout=30)  # type: ignore[attr-defined]
        with serving(tmp_path, env, *layout) as second:
            after = _npy(second, SMALL)
    assert after == before
    cold, restarted = _runs(tmp_path / "j.db")
    # One rank of the cold start claims the key and gives its weights; the other packs nothing.
    given = sorted(
        (e.outcome, e.bytes > 0) for r in (0, 1) for e in cold[r] if isinstance(e, WeightsKept)
    )
    assert given == [("held", False), ("kept", True)]
    for rank in (0, 1):
        assert [e.path for e in cold[rank] if isinstance(e, WeightsPath)] == ["load"]
        assert [e.path for e in restarted[rank] if isinstance(e, WeightsPath)] == ["attach"]
        (reference,) = [e for e in restarted[rank] if isinstance(e, ReferenceOutput)]
        assert reference.outcome == "matched"


def test_sleep_drains_then_refuses_and_wake_verifies_and_serves(tmp_path: Path) -> None:
    """POST /sleep waits for the request in flight, then readiness says asleep (liveness 200),
    requests and a second sleep are refused; POST /wake brings the keeper's weights back,
    verified, and the server answers as before. replay show has both transitions."""
    env = key_env()
    with (
        running_keeper(tmp_path, env) as keeper,
        serving(tmp_path, env, "--keeper", str(keeper.socket)) as client,
    ):
        before = _npy(client, SMALL)
        long_request: list[int] = []
        slow = {**SMALL, "width": 512, "height": 288, "frames": 33, "steps": 12}
        runner = threading.Thread(
            target=lambda: long_request.append(client.post("/generate", json=slow).status_code)
        )
        runner.start()
        time.sleep(0.5)
        slept = client.post("/sleep")
        runner.join(timeout=120)
        assert long_request == [200]
        assert (slept.status_code, slept.json()["status"]) == (200, "asleep")
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "asleep"})
        assert client.get("/liveness").status_code == 200
        refused = client.post("/generate", json=SMALL)
        assert refused.status_code == 503 and "asleep" in refused.text
        again = client.post("/sleep")
        assert (again.status_code, again.json()["state"]) == (409, "asleep")
        woke = client.post("/wake")
        assert (woke.status_code, woke.json()["status"]) == (200, "ready")
        assert client.get("/health").status_code == 200
        awake = client.post("/wake")
        assert (awake.status_code, awake.json()["state"]) == (409, "ready")
        assert _npy(client, SMALL) == before
        scraped = {
            (s.labels["rank"], s.labels["path"])
            for f in text_string_to_metric_families(client.get("/metrics").text)
            if f.name == "lifecycle_weights_seconds"
            for s in f.samples
        }
        assert scraped == {("0", "attach")}  # the wake's, the latest
    (run,) = _runs(tmp_path / "j.db")
    released = [e for e in run[0] if isinstance(e, WeightsReleased)]
    assert len(released) == 1 and released[0].bytes > 60 * 2**20 and released[0].reason is None
    assert released[0].device_bytes is None  # measured on CUDA alone: no device memory here
    paths = [e.path for e in run[0] if isinstance(e, WeightsPath)]
    assert paths == ["load", "attach"]
    shown = run_cli("replay", ["show", "latest", "j.db"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    states = [line.split()[1] for line in shown.stdout.splitlines() if line.startswith("  +")]
    assert states[-4:] == ["asleep", "waking", "ready", "stopped"]
    assert "weights released to the keeper" in shown.stdout
    assert "waking: weights attached from the keeper" in shown.stdout


def test_without_a_keeper_sleep_keeps_the_weights_in_the_rank(tmp_path: Path) -> None:
    """With no keeper, a sleep lets nothing go and says why; the wake still runs the fixed
    request (the first startup calibrated, at other steps: the wake's output is the reference);
    a server stopped while asleep stops cleanly, from asleep."""
    with serving(tmp_path, key_env(), "--keeper", "off") as client:
        assert client.post("/sleep").status_code == 200
        assert client.post("/wake").status_code == 200
        assert client.post("/generate", json=SMALL).status_code == 200
        assert client.post("/sleep").status_code == 200
        proc = client.proc  # type: ignore[attr-defined]
    assert proc.returncode == 0
    (run,) = _runs(tmp_path / "j.db")
    moves = [(e.source, e.dest) for e in run[0] if isinstance(e, Transition)]
    assert moves[-2:] == [("ready", "asleep"), ("asleep", "stopped")]
    released = [e for e in run[0] if isinstance(e, WeightsReleased)]
    assert {(r.bytes, r.reason) for r in released} == {(0, "no keeper holds them")}
    assert [e.outcome for e in run[0] if isinstance(e, ReferenceOutput)] == ["new"]
