"""After ready: collective records stay in each rank's ring, reach the journal only on trouble,
and a hang while serving is diagnosed as precisely as one during startup. Real `lifecycle
serve` processes with real gloo ranks on loopback, real HTTP, real SQLite journals."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.conftest import run_cli, wait_until
from tests.support import BODY, Served, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

FAST = ("--heartbeat-interval", "0.2", "--smoke-request", "off")


def rows(db: Path, where: str = "1 = 1") -> Counter[tuple[int, str]]:
    with sqlite3.connect(db) as conn:
        return Counter(
            {
                (rank, kind): n
                for rank, kind, n in conn.execute(
                    f"SELECT rank, kind, count(*) FROM events WHERE {where} GROUP BY rank, kind"
                )
            }
        )


def rank_pids(db: Path) -> dict[int, int]:
    with sqlite3.connect(db) as conn:
        found = conn.execute("SELECT rank, data FROM events WHERE kind = 'run_started'")
        return {rank: json.loads(data)["pid"] for rank, data in found}


def diagnose(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    args = ["diagnose", "latest", str(tmp_path / "j.db")]
    result = run_cli("replay", [*args, "--json"], cwd=tmp_path)
    doc = json.loads(result.stdout)
    doc["exit"] = result.returncode
    doc["text"] = run_cli("replay", args, cwd=tmp_path).stdout
    return doc


@pytest.mark.slow
def test_healthy_requests_journal_their_summaries_not_their_collectives(tmp_path: Path) -> None:
    """Two ranks serve four requests at two step counts: each journals its start and its
    finish per rank, whatever its steps; the finish counts the collectives that ran."""
    with serve(tmp_path, "--num-ranks", "2", *FAST) as served:
        served.wait_for_health(200, within=120)
        before = rows(served.db, "kind != 'heartbeat'")
        for steps in (2, 6, 2, 6):
            response = served.client.post("/generate", json={**BODY, "steps": steps})
            assert response.status_code == 200, response.text
        after = rows(served.db, "kind != 'heartbeat'")
        assert served.stop() == 0
    added = after - before
    for rank in (0, 1):
        assert added[(rank, "request_started")] == 4
        assert added[(rank, "request_finished")] == 4
        assert added[(rank, "collective_started")] == 0
        per_request = sum(n for (r, _), n in added.items() if r == rank) / 4
        assert per_request <= 10, added
    with sqlite3.connect(tmp_path / "j.db") as conn:
        finished = [
            json.loads(d)
            for (d,) in conn.execute(
                "SELECT data FROM events WHERE kind = 'request_finished' AND rank = 0 ORDER BY seq"
            )
        ]
    # The first request of a shape also creates its staging buffers (paired collectives).
    counts = [f["collectives"] for f in finished[-4:]]
    assert counts[0] >= counts[2] > 0 and counts[1] == counts[3] > counts[2]
    assert {g["group"] for g in finished[-1]["groups"]} == {"ulysses0", "world"}


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_hang_after_ready_is_diagnosed_from_the_dumped_ring(tmp_path: Path, ranks: int) -> None:
    """Rank 1 hangs half-way through the first request, with no restart left (--max-restarts
    0): its peers time out in the next
    all-to-all, write their rings, and the diagnosis names rank 1 in ready, the group and
    the sequence number the peers waited in; the 500 and serve's failure line name rank 1
    and where it hung as the diagnosis does, not the peer that failed first nor a process
    that went away (rank 1 leaves through the agreed abort)."""
    extra = ("--num-ranks", str(ranks), "--dist-timeout", "5", "--max-restarts", "0", *FAST)
    with serve(tmp_path, *extra, "--fault", "1:request:hang") as served:
        served.wait_for_health(200, within=180)
        response = served.client.post("/generate", json={**BODY, "steps": 4})
        assert response.status_code == 500
        assert "CollectiveTimeout" in response.text
        answer = response.json()
        assert answer["culprit_rank"] == 1, response.text
        assert answer["error"].startswith("hung in ready: rank 0 waited for it in "), answer
        assert answer["detail"].startswith("rank 1: hung in ready: "), answer
        assert served.stop() in (0, 1)
    said = [line for line in (tmp_path / "serve.log").read_text().splitlines()
            if line.startswith("failed: ")]  # fmt: skip
    assert said and said[0].startswith("failed: rank 1 hung in ready; then rank 0 failed"), said
    dumped = rows(tmp_path / "j.db", "kind = 'collectives_dumped'")
    assert dumped[(0, "collectives_dumped")] >= 1
    doc = diagnose(tmp_path)
    assert doc["outcome"] == "hung", doc["text"]
    assert doc["culprit_ranks"] == [1]
    assert doc["culprit_state"] == "ready"
    blocked = [e for e in doc["evidence"] if e["code"] == "blocked" and e["rank"] == 0]
    assert blocked and blocked[0]["waiting_for"] == [1], doc["text"]
    assert blocked[0]["group"] == "ulysses0" and blocked[0]["from_heartbeat"] is False
    with sqlite3.connect(tmp_path / "j.db") as conn:
        (top,) = conn.execute(
            "SELECT max(group_seq) FROM events WHERE rank = 0 AND kind = 'collective_started'"
            " AND group_name = 'ulysses0'"
        ).fetchone()
    assert blocked[0]["group_seq"] == top
    assert f"#{top} of ulysses0" in doc["text"]


@pytest.mark.slow
def test_a_hang_killed_before_any_dump_is_placed_by_heartbeats(tmp_path: Path) -> None:
    """The same hang, with every process SIGKILLed before the collective timeout (a pod
    deleted): no ring reaches the journal, and the heartbeats still name rank 1, the group,
    and the sequence number rank 0 waited in, said to come from a heartbeat."""
    extra = ("--num-ranks", "2", "--dist-timeout", "120", *FAST)
    with serve(tmp_path, *extra, "--fault", "1:request:hang") as served:
        served.wait_for_health(200, within=120)
        pids = rank_pids(served.db)
        asked = threading.Thread(target=_post_and_forget, args=(served,), daemon=True)
        asked.start()

        def waiting_in_a_collective() -> bool:
            with sqlite3.connect(served.db) as conn:
                beats = conn.execute(
                    "SELECT data FROM events WHERE rank = 0 AND kind = 'heartbeat'"
                    " ORDER BY seq DESC LIMIT 1"
                ).fetchall()
            return (
                bool(beats) and (json.loads(beats[0][0])["pending"] or {}).get("waiting_s", 0) > 3
            )

        wait_until(waiting_in_a_collective, within=60, what="rank 0 waiting 3 s in a collective")
        for pid in (*pids.values(), served.proc.pid):
            os.kill(pid, signal.SIGKILL)
        served.proc.wait(timeout=30)
        served.client.close()
        asked.join(timeout=30)
    assert rows(tmp_path / "j.db", "kind = 'collectives_dumped'") == Counter()
    doc = diagnose(tmp_path)
    assert doc["outcome"] == "hung", doc["text"]
    assert doc["culprit_ranks"] == [1]
    blocked = [e for e in doc["evidence"] if e["code"] == "blocked"]
    assert [(e["rank"], e["group"], e["waiting_for"]) for e in blocked] == [(0, "ulysses0", [1])]
    assert blocked[0]["from_heartbeat"] is True
    assert "seen by its last heartbeat" in doc["text"]


def _post_and_forget(served: Served) -> None:
    # The server is killed under it.
    with (
        httpx.Client(timeout=90) as client,
        contextlib.suppress(httpx.HTTPError),
    ):
        client.post(f"{served.url}/generate", json={**BODY, "steps": 4})


@pytest.mark.slow
def test_dumps_on_request_write_every_rank_ring(tmp_path: Path) -> None:
    """POST /debug/dump and SIGUSR1 each write the ring: a `collectives_dumped` marker with
    its reason, followed by the collective records of the requests since the last dump."""
    with serve(tmp_path, "--num-ranks", "2", *FAST) as served:
        served.wait_for_health(200, within=120)
        assert served.client.post("/generate", json=BODY).status_code == 200
        answer = served.client.post("/debug/dump")
        assert answer.status_code == 200 and answer.json() == {"ranks": [0, 1]}
        wait_until(
            lambda: len(rows(served.db, "kind = 'collectives_dumped'")) == 2,
            within=30,
            what="both ranks dumped",
        )
        assert served.client.post("/generate", json=BODY).status_code == 200
        os.kill(rank_pids(served.db)[1], signal.SIGUSR1)
        wait_until(
            lambda: rows(served.db, "kind = 'collectives_dumped'")[(1, "collectives_dumped")] == 2,
            within=30,
            what="rank 1 dumped on SIGUSR1",
        )
        assert served.stop() == 0
    with sqlite3.connect(tmp_path / "j.db") as conn:
        markers = conn.execute(
            "SELECT rank, seq, data FROM events WHERE kind = 'collectives_dumped'"
            " ORDER BY rank, seq"
        ).fetchall()
        reasons = [(rank, json.loads(data)["reason"]) for rank, _, data in markers]
        assert reasons == [(0, "http"), (1, "http"), (1, "signal")]
        for rank, seq, data in markers:
            records = json.loads(data)["records"]
            assert records > 0
            following = conn.execute(
                "SELECT count(*) FROM events WHERE rank = ? AND seq > ? AND seq <= ?"
                " AND kind IN ('collective_started', 'collective_finished')",
                (rank, seq, seq + records),
            ).fetchone()[0]
            assert following == records


# Slow tier: a hang after ready diagnosed from the dumped ring is the default run's, and a
# stuck rank failing its request is tests/lifecycle/test_server_reliability.py's.
@pytest.mark.slow
def test_a_request_given_up_for_silence_fails_the_server_and_the_verdict(tmp_path: Path) -> None:
    """One rank hangs in a request outside any collective, and no restart is left
    (--max-restarts 0): the server gives the request up once the rank has made no step for
    --request-silence, the rank journals why (its reader thread, since its main thread is
    stuck), serve exits 1 after --linger, and `replay
    diagnose` says failed, naming the request given up, where it said ready."""
    extra = ("--request-silence", "4", "--linger", "1", "--max-restarts", "0", *FAST)
    with serve(tmp_path, *extra, "--fault", "0:request:hang") as served:
        served.wait_for_health(200, within=180)
        response = served.client.post("/generate", json={**BODY, "steps": 4}, timeout=120)
        assert response.status_code == 500
        assert "no progress" in response.text
        assert served.proc.wait(timeout=120) == 1
    doc = diagnose(tmp_path)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "failed", [0], "ready",
    ), doc["text"]  # fmt: skip
    assert doc["exit"] == 1
    assert "RequestStalled" in doc["text"] and "made no progress" in doc["text"]
