"""Serving across nodes under torchrun (docs/nodes.md): two torchrun agents on
this host with a c10d rendezvous, one rank each, against the same layout under single-host
`serve`; and how long after a node dies rank 0's /liveness answers 503."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.historyboots import query
from bench.procs import stop_groups
from bench.stats import interleave, median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_seconds, ratio_at_most, verdict

RANKS = 2
MODEL = "micro-video"
REQUEST = {"prompt": "a red fox in the snow", "steps": 8, "width": 256, "height": 144}
GENERATE_TARGET = 1.05
LIVENESS_TARGET_S = 5.0
READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 180.0
LIVENESS_TIMEOUT_S = 60.0
POLL_S = 0.02
ENV = {"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def _wait(url: str, want: int, *, within: float, procs: list[subprocess.Popen[bytes]]) -> float:
    """Poll `url` until it answers `want`; the seconds it took."""
    started = time.monotonic()
    while time.monotonic() - started < within:
        if _status(url) == want:
            return time.monotonic() - started
        if all(p.poll() is not None for p in procs):
            raise BenchError(f"every server process exited before {url} answered {want}")
        time.sleep(POLL_S)
    raise BenchError(f"{url} did not answer {want} within {within:.0f} s")


def _generate(url: str) -> float:
    """One /generate; the seconds to its reply."""
    body = json.dumps(REQUEST).encode()
    request = urllib.request.Request(
        f"{url}/generate", data=body, headers={"content-type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
        reply.read()
    return time.perf_counter() - started


@dataclass
class Server:
    url: str
    procs: list[subprocess.Popen[bytes]]
    folders: list[Path]

    def stop(self) -> None:
        stop_groups(self.procs)


def _spawn(command: list[str], folder: Path) -> subprocess.Popen[bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "out.txt").open("wb") as log:
        return subprocess.Popen(
            command, cwd=folder, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, **ENV}, start_new_session=True,
        )  # fmt: skip


def _serve_args(port: int, db: str) -> list[str]:
    return ["-m", "lifecycle", "serve", "--model", MODEL, "--num-ranks", str(RANKS),
            "--port", str(port), "--db", db, "--linger", "1", "--log-level", "warning"]  # fmt: skip


@contextlib.contextmanager
def single_host(workdir: Path) -> Iterator[Server]:
    port = _free_port()
    folder = workdir / f"single-{port}"
    proc = _spawn([sys.executable, *_serve_args(port, "j.db")], folder)
    server = Server(url=f"http://127.0.0.1:{port}", procs=[proc], folders=[folder])
    try:
        _wait(f"{server.url}/health", 200, within=READY_TIMEOUT_S, procs=server.procs)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def two_nodes(workdir: Path) -> Iterator[Server]:
    """Two torchrun agents, one rank each; node 0's agent hosts the rendezvous and, started
    first, runs global rank 0 (c10d numbers nodes by their agents' pids)."""
    port, rdzv = _free_port(), _free_port()
    rdzv_id = uuid.uuid4().hex[:12]
    procs, folders = [], []
    for node in (0, 1):
        if node == 1:
            _wait_for_listener(rdzv)
        folder = workdir / f"nodes-{port}" / f"node{node}"
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", rdzv_id,
                   "--max-restarts", "0", *_serve_args(port, f"node{node}.db")]  # fmt: skip
        procs.append(_spawn(command, folder))
        folders.append(folder)
    server = Server(url=f"http://127.0.0.1:{port}", procs=procs, folders=folders)
    try:
        _wait(f"{server.url}/health", 200, within=READY_TIMEOUT_S, procs=server.procs)
        yield server
    finally:
        server.stop()


def _wait_for_listener(port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1.0):
            return
        time.sleep(POLL_S)
    raise BenchError(f"no rendezvous on 127.0.0.1:{port}")


def _rank_pid(db: Path, rank: int) -> int:
    rows = query(db, "SELECT data FROM events WHERE kind = 'run_started' AND rank = ?", rank)
    if not rows:
        raise BenchError(f"{db} holds no run_started of rank {rank}")
    return int(json.loads(str(rows[0][0]))["pid"])


def _node_death(workdir: Path) -> float:
    """Kill node 1 (its agent, then its rank) once the two nodes serve; seconds from the
    kill to rank 0's /liveness answering 503."""
    with two_nodes(workdir) as server:
        _generate(server.url)
        worker = _rank_pid(server.folders[1] / "node1.db", 1)
        killed = time.monotonic()
        os.killpg(server.procs[1].pid, signal.SIGKILL)
        os.kill(worker, signal.SIGKILL)
        _wait(f"{server.url}/liveness", 503, within=LIVENESS_TIMEOUT_S, procs=server.procs[:1])
        return time.monotonic() - killed


def measure(settings: Settings) -> list[Row]:
    pairs = 1 if settings.quick else 5
    deaths = 1 if settings.quick else 3
    progress(f"nodes: /generate, single-host serve and 2 torchrun nodes, {pairs} each")
    with single_host(settings.workdir) as single, two_nodes(settings.workdir) as nodes:
        timed = interleave(
            lambda: _generate(nodes.url), lambda: _generate(single.url), pairs=pairs, discard=1
        )
    seen = []
    for index in range(deaths):
        progress(f"nodes: node death {index + 1}/{deaths}")
        seen.append(_node_death(settings.workdir))
    died = median(seen)
    ratio = timed.paired_ratio
    shape = f"{REQUEST['width']}x{REQUEST['height']}, {REQUEST['steps']} steps"
    return [
        Row(
            figure=f"serve across nodes: /generate, 2 nodes x 1 rank ({MODEL})",
            value=format_seconds(median(timed.a)),
            baseline=f"{format_seconds(median(timed.b))} single-host serve, {RANKS} ranks",
            **ratio_at_most(ratio, GENERATE_TARGET, spec="g"),
            how=f"POST /generate ({shape}) to rank 0 of two torchrun agents on this host (c10d"
            f" rendezvous, --nproc-per-node 1 each) against `lifecycle serve --num-ranks"
            f" {RANKS}`, both up at once and alternated, {pairs} pairs after one of each; the"
            " median of the paired ratios",
        ),
        Row(
            figure="serve across nodes: a node's death to /liveness 503 on rank 0",
            value=format_seconds(died),
            baseline="-",
            ratio="-",
            target=verdict(f"<= {LIVENESS_TARGET_S:g} s", met=died <= LIVENESS_TARGET_S),
            how="SIGKILL to node 1's torchrun agent and then its rank, while idle after a"
            f" request; polled every {POLL_S * 1000:.0f} ms; median of {deaths} (each: "
            + ", ".join(format_seconds(s) for s in seen)
            + ")",
        ),
    ]


BENCHMARK = Benchmark(name="nodes", measure=measure)
