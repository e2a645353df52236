"""`lifecycle serve` under torchrun across nodes (docs/nodes.md): two real
torchrun agents on 127.0.0.1 with a c10d rendezvous, each a "node" with one rank and its own
journal file, serve as one server from global rank 0; a request runs on both; the node of
rank 1 killed (its agent and its rank, SIGKILL) turns /liveness 503, rank 0's serve exits 1
after --linger, and `replay diagnose` over both journals names rank 1."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest

from bench.procs import stop_groups
from lifecycle.core.format.events import Error, RequestFinished, RunStarted, Shutdown
from lifecycle.core.format.records import StageRecord
from lifecycle.serve.ranks.messages import Progress, Result
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.serve.ranks.wire import from_wire, to_wire
from tests.support import journal_events

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

READY_WITHIN_S = 240.0
LIVENESS_WITHIN_S = 30.0  # a bound on the wait, not a measure (bench/nodes.py measures it)
LINGER_S = 2


def _wait_for_port(port: int, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1.0):
            return
        time.sleep(0.05)
    raise AssertionError(f"nothing listened on 127.0.0.1:{port} within {within:.0f} s")


class Nodes:
    """Two torchrun agents, one rank each, as two nodes of one host."""

    def __init__(self, tmp_path: Path, port: int, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.dirs = [tmp_path / "node0", tmp_path / "node1"]
        self.agents: list[subprocess.Popen[str]] = []
        self.logs: list[IO[str]] = []
        rdzv_port = free_port()
        endpoint = f"127.0.0.1:{rdzv_port}"
        rdzv_id = uuid.uuid4().hex[:12]
        for node, folder in enumerate(self.dirs):
            if node == 1:
                # As a leader pod does: node 0's agent hosts the rendezvous, and joined first
                # (c10d numbers the nodes by their agents' pids), it runs global rank 0.
                _wait_for_port(rdzv_port)
            folder.mkdir()
            self.logs.append((folder / "out.txt").open("w"))
            agent = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                 "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--max-restarts", "0",
                 "-m", "lifecycle", "serve", "--model", "micro-video", "--num-ranks", "2",
                 "--port", str(port), "--db", f"node{node}.db", "--linger", str(LINGER_S),
                 "--log-level", "warning"],
                cwd=folder, stdout=self.logs[-1],
                stderr=subprocess.STDOUT, text=True, start_new_session=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
                     **(env or {})},
            )  # fmt: skip
            self.agents.append(agent)
        self.client = httpx.Client(base_url=self.url, timeout=120.0)

    def db(self, node: int) -> Path:
        return self.dirs[node] / f"node{node}.db"

    def get(self, path: str) -> httpx.Response | None:
        try:
            return self.client.get(path)
        except httpx.TransportError:
            return None

    def wait_for(
        self, path: str, status: int, *, within: float, serving: int | None = None
    ) -> float:
        """Poll `path` until it answers `status` (while the agents, or the one of index
        `serving`, run); the seconds it took."""
        started = time.monotonic()
        watched = self.agents if serving is None else [self.agents[serving]]
        while time.monotonic() - started < within:
            ended = [a.returncode for a in watched if a.poll() is not None]
            response = self.get(path)
            if response is not None and response.status_code == status:
                return time.monotonic() - started
            if ended and response is None:
                raise AssertionError(f"an agent exited ({ended}) before {path} answered {status}")
            time.sleep(0.1)
        raise AssertionError(f"{path} never answered {status} within {within:.0f} s")

    def node_of_rank(self, rank: int) -> int:
        for node in (0, 1):
            if any(s.rank == rank for s in journal_events(self.db(node))):
                return node
        raise AssertionError(f"no journal holds rank {rank}")

    def pid_of_rank(self, rank: int) -> int:
        events = journal_events(self.db(self.node_of_rank(rank)))
        return next(s.event.pid for s in events if isinstance(s.event, RunStarted))

    def close(self) -> None:
        self.client.close()
        stop_groups(self.agents)
        for log in self.logs:
            log.close()


@contextlib.contextmanager
def two_nodes(tmp_path: Path, env: dict[str, str] | None = None) -> Iterator[Nodes]:
    nodes = Nodes(tmp_path, free_port(), env)
    try:
        yield nodes
    finally:
        nodes.close()


def test_two_nodes_serve_as_one_and_a_lost_node_fails_fast(tmp_path: Path) -> None:
    """Two nodes serve as one from rank 0 (each rank with its host, the store unauthenticated
    without a key, as each node says once at start); a request runs on both; node 1 killed
    turns /liveness 503 with rank 1 shown lost, rank 0's serve exits 1 after --linger, and
    `replay diagnose` over both journals names rank 1."""
    with two_nodes(tmp_path) as nodes:
        nodes.wait_for("/health", 200, within=READY_WITHIN_S)
        shown = nodes.client.get("/lifecycle").json()
        assert [(r["rank"], r["state"], r["host"]) for r in shown["ranks"]] == [
            (0, "ready", socket.gethostname()),
            (1, "ready", socket.gethostname()),
        ]
        assert shown["store"] == {"authenticated": False, "rejected": 0}
        metrics = nodes.client.get("/metrics").text
        assert f'lifecycle_rank_info{{host="{socket.gethostname()}",rank="1"}} 1.0' in metrics

        reply = nodes.client.post(
            "/generate", json={"prompt": "a red fox", "steps": 2, "width": 256, "height": 144}
        )
        assert reply.status_code == 200, reply.text
        request_id = reply.json()["request_id"]
        # The request ran on both nodes: each journaled its end of it.
        for node in (0, 1):
            finished = [
                s.event
                for s in journal_events(nodes.db(node))
                if isinstance(s.event, RequestFinished) and s.event.request_id == request_id
            ]
            assert len(finished) == 1 and finished[0].ok, node

        assert nodes.node_of_rank(1) == 1
        lead = nodes.agents[0]
        worker = nodes.pid_of_rank(1)
        os.killpg(nodes.agents[1].pid, signal.SIGKILL)  # the agent first: no restart
        os.kill(worker, signal.SIGKILL)
        nodes.wait_for("/liveness", 503, within=LIVENESS_WITHIN_S, serving=0)
        shown = nodes.client.get("/lifecycle").json()
        assert shown["failure"].startswith("rank 1 "), shown["failure"]
        assert (shown["ranks"][1]["state"], shown["ranks"][1]["healthy"]) == ("lost", False)
        # Rank 0's node serves the failure for --linger, then its serve (and agent) exit 1.
        assert lead.wait(timeout=60 + LINGER_S) != 0

    journals = [str(nodes.db(0)), str(nodes.db(1))]
    diagnosed = subprocess.run(
        [sys.executable, "-m", "replay", "diagnose", "latest", *journals, "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    verdict = json.loads(diagnosed.stdout)
    assert verdict["outcome"] == "crashed", verdict["summary"]
    assert verdict["culprit_ranks"][0] == 1, verdict["summary"]
    for node in (0, 1):
        said = (nodes.dirs[node] / "out.txt").read_text()
        assert said.count("the rendezvous store is unauthenticated") == 1, said[-2000:]
    # Rank 0 learned of the loss from the store (the agreed abort), not from --linger's end.
    assert verdict["ranks"][0]["status"] == "aborted", verdict["summary"]
    assert "different config" not in diagnosed.stderr, diagnosed.stderr


def test_a_rank_ended_by_a_signal_as_it_resumes_after_its_loss_is_journaled_lost(
    tmp_path: Path,
) -> None:
    """Rank 1's process stopped (SIGSTOP) until the group takes it for lost, then given SIGTERM
    as it resumes, as its agent ends a worker whose group went on without it: the rank journals
    that it was taken for lost (a fatal `rank-lost`, ending failed), not a stop by the signal,
    whichever of its threads sees the end first."""
    with two_nodes(tmp_path) as nodes:
        nodes.wait_for("/health", 200, within=READY_WITHIN_S)
        worker = nodes.pid_of_rank(1)
        os.kill(worker, signal.SIGSTOP)
        try:
            nodes.wait_for("/liveness", 503, within=LIVENESS_WITHIN_S, serving=0)
            os.kill(worker, signal.SIGTERM)  # pending: the first thing it meets as it resumes
        finally:
            os.kill(worker, signal.SIGCONT)
        statuses = [agent.wait(timeout=60 + LINGER_S) for agent in nodes.agents]
        assert all(status != 0 for status in statuses), statuses
    rank1 = journal_events(nodes.db(1))
    fatal = [s.event for s in rank1 if isinstance(s.event, Error) and s.event.fatal]
    stops = [s.event for s in rank1 if isinstance(s.event, Shutdown)]
    assert [e.error_kind for e in fatal] == ["rank-lost"], (fatal, stops)
    assert "taken for lost" in fatal[0].message, fatal[0].message
    assert max(rank1, key=lambda s: s.seq).state == "failed", stops


# Slow tier: two nodes serving as one, and a lost node failing the group, are the default run's;
# a rank stopped by a signal under torchrun is tests/lifecycle/test_torchrun_env.py's.
@pytest.mark.slow
def test_a_signal_to_the_leader_stops_every_node(tmp_path: Path) -> None:
    """SIGTERM to node 0's agent (as when its pod is deleted): rank 0 tells every other rank
    to stop before it journals its own stop, so that each journals a stop, not rank 0's loss,
    and every torchrun exits."""
    with two_nodes(tmp_path) as nodes:
        nodes.wait_for("/health", 200, within=READY_WITHIN_S)
        os.kill(nodes.agents[0].pid, signal.SIGTERM)
        for agent in nodes.agents:
            agent.wait(timeout=60)
    journals = [str(nodes.db(0)), str(nodes.db(1))]
    diagnosed = subprocess.run(
        [sys.executable, "-m", "replay", "diagnose", "latest", *journals, "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    ranks = {r["rank"]: r for r in json.loads(diagnosed.stdout)["ranks"]}
    assert ranks[0]["state"] == ranks[1]["state"] == "stopped", ranks
    assert ranks[1]["stop_reason"] == "rank 0 received SIGTERM", ranks[1]


def test_the_wire_takes_only_the_named_ranks_messages() -> None:
    """What a rank publishes in the store reads back as it was; anything else (not JSON, an
    unknown type, a message naming another rank) is dropped, never unpickled."""
    result = Result(
        request_id="r1",
        rank=1,
        ok=True,
        checksum="ab",
        total_s=1.5,
        step_s=(0.5, 1.0),
        stages=(StageRecord(name="dit", ran=True, seconds=1.0, peak_bytes=None),),
    )
    assert from_wire(to_wire(result), run_id="x", rank=1) == result
    progress = Progress(request_id="r1", rank=1, step=3)
    assert from_wire(to_wire(progress), run_id="x", rank=1) == progress
    assert from_wire(to_wire(progress), run_id="x", rank=2) is None
    for junk in (b"\x80\x04K\x01.", b"{}", b'{"type": "result", "message": "{}"}', b"[1]"):
        assert from_wire(junk, run_id="x", rank=1) is None


def test_a_rank_is_judged_lost_only_once_it_has_beaten() -> None:
    """Rank 0's reader of a rank through a real TCPStore: a rank that has not beaten yet is
    starting (its node may come up long after this one), never lost; once it has beaten and
    stops for LOST_S, it is lost."""
    import datetime
    import threading

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    from lifecycle.runtime.group.storetrust import RunKey, StoreTrust
    from lifecycle.serve.ranks import crossnode
    from lifecycle.serve.ranks.upreader import StoreReader
    from lifecycle.serve.ranks.wire import beat_key

    port = free_port()
    store = TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=10))  # fmt: skip
    lost: list[str] = []
    judged = threading.Event()

    def on_lost(rank: int, why: str) -> None:
        lost.append(f"rank {rank}: {why}")
        judged.set()

    trust = StoreTrust(RunKey(None, run_id="r"))  # unsealed, as without a store key
    reader = StoreReader(
        TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=10)),
        trust=trust, rank=1, on_message=lambda item: None, on_beat=lambda rank: None,
        on_lost=on_lost,
    )  # fmt: skip
    reader.start()
    try:
        assert not judged.wait(crossnode.LOST_S + 1.0), lost  # silent from the start: starting
        store.set(beat_key("r", 1), b"1")  # it beats once, then no more
        assert judged.wait(crossnode.LOST_S + 5.0), "a rank that stopped beating was not lost"
        assert lost[0].startswith("rank 1: no beat for"), lost
    finally:
        reader.close()
