"""`lifecycle serve` under stress: stuck or killed ranks, big bodies, load, SIGTERM mid-request."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from lifecycle.core.format.events import (
    Aborted,
    Error,
    RequestStarted,
    RunStarted,
    Shutdown,
    Transition,
)
from lifecycle.runtime.injection import FAULT_EXIT_CODE
from tests.conftest import run_cli, wait_until
from tests.support import BODY, Served, journal_events, serve

PROBE_TIMEOUT_S = 3.0  # a Kubernetes probe's default timeout is 1 s; this allows a loaded CI

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

FAST = ("--heartbeat-interval", "0.2")
# On two ranks sharing two CPU cores, about 15 s and over a minute.
LONG = {**BODY, "width": 512, "height": 288, "frames": 33, "steps": 200}
LONGER = {**BODY, "width": 1536, "height": 864, "frames": 33, "steps": 200}
SMALL = {**BODY, "width": 128, "height": 128, "frames": 1, "steps": 1}


def rank_pids(db: Path) -> dict[int, int]:
    return {e.rank: e.event.pid for e in journal_events(db) if isinstance(e.event, RunStarted)}


def serving_request_on_every_rank(db: Path, ranks: int) -> Callable[[], bool]:
    """True once every rank journaled the start of an HTTP request."""

    def started() -> bool:
        events = journal_events(db)
        return {
            e.rank
            for e in events
            if isinstance(e.event, RequestStarted) and e.event.source == "http"
        } == set(range(ranks))

    return started


def process_gone(pid: int) -> Callable[[], bool]:
    """True once `pid` has exited (a zombie not yet reaped counts as gone)."""

    def gone() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] == "Z"
        except OSError:
            return True

    return gone


def frozen(pid: int) -> Callable[[], bool]:
    """True once every thread of `pid` is stopped by a signal."""

    def stopped() -> bool:
        states = [
            (task / "stat").read_text().split(") ")[-1][:1]
            for task in Path(f"/proc/{pid}/task").iterdir()
        ]
        return all(state == "T" for state in states)

    return stopped


def freeze(pid: int, db: Path) -> None:
    """SIGSTOP `pid` while holding the journal's write lock: the ranks share the journal, and
    a rank frozen in the middle of a commit would lock every other rank out of it."""
    lock = sqlite3.connect(db, isolation_level=None, timeout=30)
    try:
        lock.execute("BEGIN IMMEDIATE")
        os.kill(pid, signal.SIGSTOP)
        wait_until(frozen(pid), within=10, what=f"process {pid} stopping")
        lock.execute("ROLLBACK")
    finally:
        lock.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def chunks(total: int, size: int) -> Iterator[bytes]:
    """A JSON-looking body of `total` bytes, `size` at a time, made as it is sent."""
    yield b'{"prompt": "'
    for _ in range(total // size):
        yield b"x" * size


def post_chunked(url: str, body: Iterator[bytes]) -> tuple[str, int]:
    """POST `body` to /generate with Transfer-Encoding: chunked, stopping at the first sign
    of a response; return the response's status line and the body bytes sent before it."""
    host, port = url.removeprefix("http://").split(":")
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        try:
            for piece in body:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered before the body was over
                sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sent += len(piece)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = b""
        while b"\r\n" not in response:
            data = sock.recv(4096)
            if not data:
                break
            response += data
    return response.split(b"\r\n")[0].decode(), sent


def stop_within(served: Served, seconds: float) -> int:
    """SIGTERM the server; its exit status, which must come within `seconds`."""
    served.proc.send_signal(signal.SIGTERM)
    try:
        return served.proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve still running {seconds} s after SIGTERM") from None
    finally:
        served.client.close()


def test_a_stuck_rank_fails_the_request_and_no_later_request_gets_its_reply(
    tmp_path: Path,
) -> None:
    """When rank 1 freezes mid-request and no restart is left (--max-restarts 0), the request
    is answered 500 as soon as rank 0's collective times out, without waiting for rank 1; the
    ranks are then unhealthy (503), and
    neither a request sent while rank 1 is still in the abandoned request nor one sent after
    its late reply is answered with that reply."""
    extra = ("--num-ranks", "2", "--dist-timeout", "3", "--max-restarts", "0")
    with serve(tmp_path, *extra, *FAST) as served:
        served.wait_for_health(200, within=120)
        pids = rank_pids(served.db)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(served.client.post, "/generate", json=LONG)
            wait_until(serving_request_on_every_rank(served.db, 2), within=60, what="request start")
            try:
                freeze(pids[1], served.db)
                answered = first.result(timeout=60)
                assert answered.status_code == 500, answered.text
                reply = answered.json()
                # Rank 0 timed out waiting; the frozen rank 1 is the culprit the reply names.
                assert reply["culprit_rank"] == 1, reply
                # Frozen before it entered the collective rank 0 waits in, or inside it (the
                # two are a moment apart): either way it hung there.
                assert reply["error"].startswith(
                    ("hung in ready: rank 0 waited for it in ", "hung in ready: inside ")
                ), reply
                assert reply["waited"]["0"].startswith("CollectiveTimeout"), reply
                health = served.get("/health")
                assert health is not None and health.status_code == 503
                assert health.json() == {"status": "failed"}
                meanwhile = served.client.post("/generate", json=SMALL, timeout=30)
                assert meanwhile.status_code == 503, meanwhile.text
            finally:
                os.kill(pids[1], signal.SIGCONT)
        # Rank 1 goes on with the abandoned request, finds rank 0 gone, and replies late.
        wait_until(process_gone(pids[1]), within=60, what="rank 1 leaving")
        after = served.client.post("/generate", json=SMALL, timeout=30)
        assert after.status_code == 503, after.text
        assert stop_within(served, 60) == 1
    events = journal_events(served.db)
    errors = [e for e in events if isinstance(e.event, Error)]
    assert errors[0].rank == 0 and errors[0].event.error_type == "CollectiveTimeout"
    assert {e.rank for e in errors} == {0}
    # Thawed, rank 1 learns of rank 0's failure and stops through the agreed abort.
    aborts = [e for e in events if isinstance(e.event, Aborted)]
    assert [(e.rank, e.event.failed_rank) for e in aborts] == [(1, 0)]


def test_a_failed_request_names_its_culprit_its_id_and_the_diagnose_command(
    tmp_path: Path,
) -> None:
    """Rank 1's process ends half-way through a request while rank 0 waits on it in a
    collective: the 500 names rank 1 and its error (not rank 0, which failed waiting), the
    request id every rank journaled it under (as sent in X-Request-ID, and echoed), and the
    `replay diagnose` command, which run as given names rank 1 too."""
    extra = ("--num-ranks", "2", "--max-restarts", "0", *FAST)
    with serve(tmp_path, *extra, "--fault", "1:request:exit") as served:
        served.wait_for_health(200, within=120)
        answered = served.client.post(
            "/generate", json={**BODY, "steps": 4}, headers={"X-Request-ID": "req-7.a"}
        )
        assert answered.status_code == 500, answered.text
        assert answered.headers["X-Request-ID"] == "req-7.a"
        reply = answered.json()
        assert reply["request_id"] == "req-7.a"
        assert reply["culprit_rank"] == 1, reply
        # Its process ended without a word: it crashed, as the verdict says.
        assert reply["error"] == f"crashed in ready: exit {FAULT_EXIT_CODE}", reply
        assert set(reply["waited"]) <= {"0"}, reply
        assert reply["detail"].startswith(f"rank 1: crashed in ready: exit {FAULT_EXIT_CODE}")
        (run,) = {e.run_id for e in journal_events(served.db)}
        assert reply["diagnose"] == f"replay diagnose {run} j.db"
        stop_within(served, 60)
    journaled = {
        e.rank for e in journal_events(served.db)
        if isinstance(e.event, RequestStarted) and e.event.request_id == "req-7.a"
    }  # fmt: skip
    assert journaled == {0, 1}
    command = reply["diagnose"].split()
    diagnosed = run_cli(command[0], [*command[1:], "--json"], cwd=tmp_path, timeout=120)
    assert json.loads(diagnosed.stdout)["culprit_ranks"] == [1], diagnosed.stdout


def test_a_rank_killed_after_ready_turns_health_503_and_serve_exits_1(tmp_path: Path) -> None:
    """SIGKILL of a rank after ready turns /health 503 (failed) at once, /generate is refused,
    and `serve` exits 1 when stopped."""
    with serve(tmp_path, "--num-ranks", "2", *FAST) as served:
        served.wait_for_health(200, within=120)
        os.kill(rank_pids(served.db)[1], signal.SIGKILL)
        served.wait_for_health(503, within=5)
        for _ in range(5):
            health = served.get("/health")
            assert health is not None and health.status_code == 503
            assert health.json() == {"status": "failed"}
        assert served.client.post("/generate", json=SMALL).status_code == 503
        assert "rank 1" in served.client.get("/lifecycle").json()["failure"]
        assert stop_within(served, 60) == 1


def test_a_chunked_body_over_the_limit_is_refused_before_it_is_all_sent(tmp_path: Path) -> None:
    """A 64 MiB chunked body (no Content-Length) gets 413 once 64 KiB have arrived, long before
    the client is done sending, and the server does not hold the body in memory."""
    total = 64 * 2**20
    with serve(tmp_path, "--num-ranks", "1", *FAST) as served:
        wait_until(lambda: served.get("/liveness") is not None, within=60, what="listening")
        before = rss_bytes(served.proc.pid)
        status, sent = post_chunked(served.url, chunks(total, 64 * 1024))
        grown = rss_bytes(served.proc.pid) - before
        assert status == "HTTP/1.1 413 Request Entity Too Large", status
        assert sent < total // 4
        assert grown < 16 * 2**20
        stop_within(served, 60)


@pytest.mark.slow
def test_probes_answer_at_once_while_generate_requests_pile_up(tmp_path: Path) -> None:
    """With 60 /generate requests at once, /liveness, /health and /lifecycle each answer
    within a second; the requests beyond the line's capacity get 503 with Retry-After and
    the others 200."""
    request = {**BODY, "width": 512, "height": 288, "frames": 33, "steps": 3}
    with serve(tmp_path, "--num-ranks", "1", *FAST) as served:
        served.wait_for_health(200, within=120)
        client = httpx.Client(
            base_url=served.url, timeout=120, limits=httpx.Limits(max_connections=100)
        )
        try:
            with ThreadPoolExecutor(60) as pool:
                pending = [pool.submit(client.post, "/generate", json=request) for _ in range(60)]
                wait_until(
                    serving_request_on_every_rank(served.db, 1), within=60, what="request start"
                )
                # A probe that starved behind the requests would take many seconds; its
                # bounded wait fails the test (timing proper is bench's business).
                for path in ("/liveness", "/health", "/lifecycle", "/liveness"):
                    assert client.get(path, timeout=PROBE_TIMEOUT_S).status_code == 200
                responses = [p.result(timeout=120) for p in pending]
        finally:
            client.close()
        statuses = sorted({r.status_code for r in responses})
        assert statuses == [200, 503]
        busy = [r for r in responses if r.status_code == 503]
        assert all(r.headers.get("retry-after") for r in busy)
        assert all(r.json()["detail"].startswith("busy") for r in busy)
        assert stop_within(served, 60) == 0


@pytest.mark.slow
def test_sigterm_during_a_long_request_stops_serve_and_every_rank_journals_it(
    tmp_path: Path,
) -> None:
    """SIGTERM while both ranks are deep in a 200-step request: the request is answered 503
    (server stopping), `serve` exits 0 well within 30 s, and each rank's journal ends with
    its shutdown by SIGTERM and the move to stopped."""
    with serve(tmp_path, "--num-ranks", "2", *FAST) as served:
        served.wait_for_health(200, within=120)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(served.client.post, "/generate", json=LONGER)
            wait_until(serving_request_on_every_rank(served.db, 2), within=60, what="request start")
            assert stop_within(served, 30) == 0
            answered = running.result(timeout=10)
        assert answered.status_code == 503, answered.text
        assert "stopping" in answered.json()["detail"]
    events = journal_events(served.db)
    for rank in (0, 1):
        tail = [e for e in events if e.rank == rank and e.kind != "heartbeat"][-2:]
        assert isinstance(tail[0].event, Shutdown), tail
        assert tail[0].event.reason == "launcher received SIGTERM"
        assert isinstance(tail[1].event, Transition) and tail[1].state == "stopped"


def held_back_ranks(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """An environment in which every rank process, before anything else, writes the control
    port its launcher gave it to a file and then waits (at most two minutes) until a second
    file exists: a test is then first at the control port, whatever the machine's load."""
    folder = tmp_path / "held-back"
    folder.mkdir()
    told, go = tmp_path / "control-port", tmp_path / "go"
    (folder / "sitecustomize.py").write_text(
        "import json, os, time\n"
        "spec = os.environ.get('LIFECYCLE_WORKER')\n"
        "if spec:\n"
        f"    with open({str(told)!r}, 'w') as told:\n"
        "        told.write(str(json.loads(spec)['control_port']))\n"
        "    deadline = time.monotonic() + 120\n"
        f"    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.05)\n"
    )
    return {"PYTHONPATH": str(folder)}, told, go


def test_strangers_on_the_control_port_do_not_keep_the_ranks_out(tmp_path: Path) -> None:
    """An idle connection and two that send garbage, all made to the launcher's control port
    before the ranks connect, neither stop the ranks from being accepted (/health turns 200)
    nor stay connected past the handshake bound, and the log holds no traceback."""
    env, told, go = held_back_ranks(tmp_path)
    with serve(tmp_path, "--num-ranks", "2", "--warmup-mode", "none", *FAST, env=env) as served:
        wait_until(lambda: told.exists() and told.read_text() != "", within=60, what="a rank")
        port = int(told.read_text())
        idle = socket.create_connection(("127.0.0.1", port), timeout=60)
        scanner = socket.create_connection(("127.0.0.1", port), timeout=60)
        scanner.sendall(b"GET / HTTP/1.1\r\nHost: lifecycle\r\n\r\n")
        framed = socket.create_connection(("127.0.0.1", port), timeout=60)
        framed.sendall(len(b"not the digest").to_bytes(4, "big") + b"not the digest")
        go.touch()
        try:
            served.wait_for_health(200, within=120)
            # The server speaks first (its challenge), then hangs up on the silent client.
            received = b""
            while chunk := idle.recv(4096):
                received += chunk
            assert received, "the idle client was sent a challenge before it was dropped"
        finally:
            for sock in (idle, scanner, framed):
                sock.close()
        assert stop_within(served, 60) == 0
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_a_rank_killed_after_ready_reads_as_killed_not_ready(tmp_path: Path) -> None:
    """A rank SIGKILLed after ready is shown by /lifecycle as exited, unhealthy and killed by
    SIGKILL (its journal's last state, ready, kept beside), and /metrics counts it unhealthy."""
    with serve(tmp_path, "--num-ranks", "1", "--warmup-mode", "none", *FAST) as served:
        served.wait_for_health(200, within=120)
        os.kill(rank_pids(served.db)[0], signal.SIGKILL)

        def rank0() -> dict[str, object]:
            ranks: list[dict[str, object]] = served.client.get("/lifecycle").json()["ranks"]
            return ranks[0]

        wait_until(lambda: rank0()["exit_code"] is not None, within=10, what="the rank's exit")
        shown = rank0()
        assert shown["state"] == "exited", shown
        assert shown["journaled_state"] == "ready"
        assert shown["healthy"] is False
        assert (shown["exit_code"], shown["exit"]) == (-9, "killed by SIGKILL")
        assert 'lifecycle_rank_healthy{rank="0"} 0.0' in served.client.get("/metrics").text
        assert stop_within(served, 60) == 1
