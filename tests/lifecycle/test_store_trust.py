"""Who may steer a run (docs/ranks.md, The agreed abort; docs/nodes.md): the launcher's
rendezvous store listens on 127.0.0.1 alone, and every message a rank reads from a store or
the control group is sealed with the run's store key; a message that is not, written by
anything that reaches the store, is dropped, counted in /metrics and journaled once, and ends
or steers nothing. Real stores (torch's TCPStore), real rank processes, a real server."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.format.events import Aborted, Error, RequestFinished, StoredEvent
from lifecycle.runtime.group.abort import Failure, abort_key
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.serve.ranks.wire import beat_key, message_key, to_wire
from tests.conftest import one_clear_line, run_cli, wait_until
from tests.lifecycle.test_torchrun_env import boot_with, rank_env, rank_process, store_listens
from tests.support import BODY, journal_events, serve

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

KEY = "0123456789abcdef" * 4
UNAUTHENTICATED = "unauthenticated-message"


# -- what listens where ------------------------------------------------------------------------


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(text)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    # /proc/net/tcp6 writes each 32-bit word of the address in the host's byte order.
    address = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return address.ipv4_mapped or address


def listening(pids: list[int]) -> set[tuple[str, int]]:
    """Every (address, port) a TCP socket of the processes `pids` listens on."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                found.add((str(_address(host)), int(port, 16)))
    return found


def environ_of(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode().split("=", 1) for p in pairs if b"=" in p)


def client(port: int) -> Any:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=10))


def unauthenticated(events: list[StoredEvent]) -> list[StoredEvent]:
    return [
        e for e in events if isinstance(e.event, Error) and e.event.error_kind == UNAUTHENTICATED
    ]


# -- the key -----------------------------------------------------------------------------------


def keyless(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("LIFECYCLE_STORE_KEY")}


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"LIFECYCLE_STORE_KEY": "short-key"}, "the store key has 9 characters, fewer than 32"),
        ({"LIFECYCLE_STORE_KEY": KEY, "LIFECYCLE_STORE_KEY_FILE": "key.txt"}, "are both set"),
        ({"LIFECYCLE_STORE_KEY_FILE": "."}, "a directory, not a regular file"),
        ({"LIFECYCLE_STORE_KEY_FILE": "absent.txt"}, "No such file or directory"),
        ({"LIFECYCLE_STORE_KEY": KEY + "\n" + KEY}, "the store key is not one line of text"),
    ],
    ids=["short", "both", "directory", "absent", "two-lines"],
)
def test_a_store_key_that_cannot_be_used_is_one_line_and_exit_2(
    tmp_path: Path, given: dict[str, str], said: str
) -> None:
    """A rank given a store key it cannot use exits 2 at start with one line saying why,
    which never shows the key, before it joins a group or writes anything."""
    (tmp_path / "key.txt").write_text(KEY)
    result = boot_with(tmp_path, {**keyless(rank_env(0, 2, free_port())), **given})
    assert result.returncode == 2, result.stderr[-2000:]
    line = one_clear_line(result)
    assert said in line and "short-key" not in line and KEY[:16] not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.txt"]


# -- the launcher's store ----------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    return None


@pytest.mark.ranks
def test_the_launchers_store_is_on_loopback_and_a_forged_abort_ends_nothing(
    tmp_path: Path,
) -> None:
    """`serve --num-ranks 2`: the launcher and its ranks listen on 127.0.0.1 alone. A failure
    of rank 1 forged in the store's abort slot by another client (compare-and-set, unsealed)
    ends nothing: /health stays 200 and /generate answers, each rank journals the dropped
    message once and /metrics and /lifecycle count it. Rank 1 killed afterwards is announced
    by the launcher in the forgery's place, and rank 0 aborts naming it: serve's failure
    line names rank 1 and rank 0 aborted (the dropped message failed nothing)."""
    with serve(tmp_path, "--num-ranks", "2", "--linger", "1") as served:
        served.wait_for_health(200, within=240)
        pids = {e.rank: e.event.pid for e in journal_events(served.db) if e.kind == "run_started"}  # type: ignore[attr-defined]
        sockets = listening([served.proc.pid, *pids.values()])
        assert len(sockets) >= 2 and {host for host, _ in sockets} == {"127.0.0.1"}, sockets
        store_port = int(environ_of(pids[0])["MASTER_PORT"])
        assert ("127.0.0.1", store_port) in sockets
        run_id = served.client.get("/lifecycle").json()["run_id"]
        forged = Failure(
            rank=1, error_type="InjectedFault", error_kind="injected-fault", message="forged",
            state="ready", wall=time.time(), announced_by="rank",
        )  # fmt: skip
        outsider = client(store_port)
        assert (
            outsider.compare_set(abort_key(run_id), "", forged.to_json())
            == forged.to_json().encode()
        )

        def counted() -> float | None:
            text = served.client.get("/metrics").text
            rejected = [metric(text, "lifecycle_store_rejected_total", rank=r) for r in "01"]
            return None if None in rejected else sum(rejected)  # type: ignore[arg-type]

        wait_until(lambda: counted() == 2, within=15, what="each rank counted the forgery")
        assert served.get("/health").status_code == 200  # type: ignore[union-attr]
        assert served.client.post("/generate", json=BODY).status_code == 200
        shown = served.client.get("/lifecycle").json()
        assert shown["store"] == {"authenticated": True, "rejected": 2}
        assert [r["first_error"]["type"] for r in shown["ranks"]] == ["UnauthenticatedMessage"] * 2
        os.kill(pids[1], signal.SIGKILL)
        served.wait_for("/liveness", 503, within=15)
        assert served.proc.wait(timeout=120) == 1
    events = journal_events(tmp_path / "j.db")
    dropped = unauthenticated(events)
    assert sorted(e.rank for e in dropped) == [0, 1]
    assert all(not e.event.fatal and "abort" in e.event.message for e in dropped)  # type: ignore[attr-defined]
    aborted = [e for e in events if isinstance(e.event, Aborted)]
    assert [(e.rank, e.event.failed_rank, e.event.announced_by) for e in aborted] == [
        (0, 1, "launcher")
    ]
    assert "killed by SIGKILL" in aborted[0].event.message
    said = [line for line in (tmp_path / "serve.log").read_text().splitlines()
            if line.startswith("failed: ")]  # fmt: skip
    assert said == [
        "failed: rank 1 crashed in ready: killed by SIGKILL; then rank 0 aborted (the agreed abort)"
    ], said


# -- ranks under torchrun's environment, on one host --------------------------------------------


@pytest.mark.ranks
def test_a_rank_hosting_the_rendezvous_for_a_loopback_master_listens_there_only(
    tmp_path: Path,
) -> None:
    """Rank 0 of two started by hand (no agent's store) for MASTER_ADDR=127.0.0.1 hosts the
    rendezvous store on 127.0.0.1 alone, with a store key in a file or none."""
    (tmp_path / "key.txt").write_text(KEY + "\n")
    for job, given in enumerate(({}, {"LIFECYCLE_STORE_KEY_FILE": "key.txt"})):
        port = free_port()
        env = {**keyless(rank_env(0, 2, port, TORCHELASTIC_RUN_ID=f"job-{job}")), **given}
        with rank_process(tmp_path, env) as rank:
            wait_until(lambda: store_listens(port), within=120, what="rank 0 at the rendezvous")  # noqa: B023
            assert ("127.0.0.1", port) in (sockets := listening([rank.proc.pid]))
            assert {host for host, _ in sockets} == {"127.0.0.1"}, sockets
            rank.proc.send_signal(signal.SIGTERM)
            status, err = rank.stopped_with(within=15)
        assert status == 143, err[-2000:]
        assert KEY[:16] not in err


@pytest.mark.ranks
def test_ranks_given_different_store_keys_stop_at_the_rendezvous_saying_so(
    tmp_path: Path,
) -> None:
    """Two ranks under torchrun's environment given different store keys: each drops the
    other's settings as not sealed with its key (journaled once), and within seconds says
    that every rank must be given the same key and exits 2."""
    port = free_port()
    envs = [
        {**keyless(rank_env(r, 2, port, TORCHELASTIC_RUN_ID="job-3")), "LIFECYCLE_STORE_KEY": key}
        for r, key in enumerate((KEY, KEY[::-1]))
    ]
    started = time.monotonic()
    with rank_process(tmp_path, envs[0]) as first, rank_process(tmp_path, envs[1]) as second:
        ended = [rank.stopped_with(within=150) for rank in (first, second)]
    for rank, (status, err) in enumerate(ended):
        assert status == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"lifecycle: error: rank {rank}: rank {1 - rank}'s settings"), last
        assert "give every rank the same LIFECYCLE_STORE_KEY" in last
        assert KEY[:16] not in err and KEY[::-1][:16] not in err
    assert time.monotonic() - started < 120
    events = journal_events(tmp_path / "j.db")
    assert sorted(e.rank for e in unauthenticated(events)) == [0, 1]


# -- across nodes (torchrun) -------------------------------------------------------------------


def forged_error(run_id: str) -> bytes:
    """A fatal error of rank 1, unsealed, as today's wire would carry it."""
    error = Error(
        error_type="InjectedFault", error_kind="injected-fault", message="forged", traceback="",
        trigger=None, fatal=True,
    )  # fmt: skip
    stored = StoredEvent(
        run_id=run_id, rank=1, seq=10**6, wall_time=time.time(), mono_ns=0, state="ready",
        event=error,
    )  # fmt: skip
    return to_wire(stored)


@contextlib.contextmanager
def forging_beats(store: Any, key: str, replayed: bytes) -> Iterator[None]:
    """Another client writes rank 1's beat every 50 ms: counts going up for 2 s, then the
    rank's own last beat, replayed."""
    stop = threading.Event()

    def forge() -> None:
        count, until = 10**6, time.monotonic() + 2.0
        while not stop.is_set():
            count += 1
            store.set(key, str(count).encode() if time.monotonic() < until else replayed)
            time.sleep(0.05)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.ranks
def test_forgeries_across_nodes_change_nothing_and_a_node_stopped_and_resumed_fails(
    tmp_path: Path,
) -> None:
    """Two torchrun nodes given one store key. Forged fatal errors and garbage written by
    another client at rank 1's next message slots in torchrun's store are dropped: /generate
    answers and nothing fails. Node 1 then stopped (SIGSTOP) while its beats are forged is
    lost within seconds: /liveness 503, /lifecycle and /metrics show rank 1 lost, and rank 0
    journals one dropped message per channel. Resumed (SIGCONT), rank 1 journals that the
    group took it for lost, and both torchruns exit non-zero; `replay diagnose` names rank 1."""
    from tests.lifecycle.test_serve_nodes import LINGER_S, READY_WITHIN_S, two_nodes

    with two_nodes(tmp_path, env={"LIFECYCLE_STORE_KEY": KEY}) as nodes:
        nodes.wait_for("/health", 200, within=READY_WITHIN_S)
        shown = nodes.client.get("/lifecycle").json()
        assert shown["store"] == {"authenticated": True, "rejected": 0}
        run_id = shown["run_id"]
        worker = nodes.pid_of_rank(1)
        outsider = client(int(environ_of(worker)["MASTER_PORT"]))
        error = forged_error(run_id)
        for seq in range(1000):  # past whatever rank 1 sent since its start
            outsider.set(message_key(run_id, 1, seq), error if seq % 2 else b"\x80garbage")
        reply = nodes.client.post("/generate", json={**BODY, "steps": 2})
        assert reply.status_code == 200, reply.text
        shown = nodes.client.get("/lifecycle").json()
        assert shown["failure"] is None and shown["store"]["rejected"] >= 1, shown
        assert [r["state"] for r in shown["ranks"]] == ["ready", "ready"]

        beat = beat_key(run_id, 1)
        # Node 1: its agent, and its rank (torchrun starts each in a session of its own).
        node1 = (nodes.agents[1].pid, worker)
        stopped_at = time.monotonic()
        try:
            with forging_beats(outsider, beat, outsider.get(beat)):
                for pid in node1:
                    os.kill(pid, signal.SIGSTOP)
                nodes.wait_for("/liveness", 503, within=15, serving=0)
                assert time.monotonic() - stopped_at < 12
                shown = nodes.client.get("/lifecycle").json()
                metrics = nodes.client.get("/metrics").text
            # Rank 0 serves the failure for --linger and exits, and its store with it, while
            # node 1 is still stopped; rank 0 told rank 1 to stop on its way out.
            lead = nodes.agents[0].wait(timeout=60 + LINGER_S)
        finally:
            for pid in node1:
                os.kill(pid, signal.SIGCONT)
        lost = shown["ranks"][1]
        assert (lost["state"], lost["healthy"], lost["journaled_state"]) == ("lost", False, "ready")
        assert lost["lost"].startswith("no beat for"), lost
        assert metric(metrics, "lifecycle_rank_healthy", rank="1") == 0
        assert metric(metrics, "lifecycle_rank_state", rank="1", state="lost") == 1
        assert metric(metrics, "lifecycle_rank_state", rank="1", state="ready") == 0
        for channel in ("up", "beat"):
            total = metric(metrics, "lifecycle_store_rejected_total", rank="0", channel=channel)
            assert total is not None and total >= 1, channel
        statuses = [lead, nodes.agents[1].wait(timeout=90)]
        assert all(status != 0 for status in statuses), statuses

    rank0, rank1 = journal_events(nodes.db(0)), journal_events(nodes.db(1))
    dropped = unauthenticated(rank0)
    assert sorted(e.event.message.split(" channel")[0] for e in dropped) == [  # type: ignore[attr-defined]
        "a message on the beat", "a message on the up",
    ]  # fmt: skip
    assert not [e for e in rank0 if isinstance(e.event, RequestFinished) and not e.event.ok]
    (taken,) = [e for e in rank1 if isinstance(e.event, Error) and e.event.fatal]
    assert taken.event.error_kind == "rank-lost", taken  # type: ignore[attr-defined]
    assert "taken for lost" in taken.event.message or "made no beat" in taken.event.message  # type: ignore[attr-defined]
    assert max(rank1, key=lambda e: e.seq).state == "failed"
    journals = [str(nodes.db(0)), str(nodes.db(1))]
    diagnosed = run_cli("replay", ["diagnose", "latest", *journals, "--json"], cwd=tmp_path)
    verdict = json.loads(diagnosed.stdout)
    assert verdict["culprit_ranks"][:1] == [1], verdict["summary"]
    assert {r["rank"]: r["status"] for r in verdict["ranks"]}[1] == "failed", verdict["summary"]
