"""What replay says of gate-check's check of the ranks: real boots whose rank 1 is slowed or
runs another torch (show, diagnose, history), and a hand-built journal for what cannot happen
here (a CUDA host, a straggler while serving)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    EnvironmentChecked,
    RankProbed,
    RequestFinished,
    RequestStarted,
)
from lifecycle.core.format.kinds.rankevents import LinkFigure, RankEnvironment
from lifecycle.core.format.records import Shape
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder
from replay.cli import main
from tests.conftest import run_cli
from tests.replay.conftest import run_ids

BOOT_TIMEOUT_S = 240  # a 4-rank startup on a loaded 2-core machine takes about 25 s


@dataclass(frozen=True)
class Booted:
    db: Path
    returncode: int
    run_id: str


def boot(db: Path, *args: str, env: dict[str, str] | None = None) -> Booted:
    """A real `lifecycle boot` of micro-video into `db`, bounded; its exit status and run."""
    done = subprocess.run(
        [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video", "--db", str(db),
         "--log-level", "error", *args],
        cwd=db.parent, capture_output=True, timeout=BOOT_TIMEOUT_S, check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
    )  # fmt: skip
    return Booted(db=db, returncode=done.returncode, run_id=run_ids(db)[-1])


def replay(*args: str, cwd: Path) -> tuple[int, str]:
    done = run_cli("replay", args, cwd=cwd, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout


def replay_json(*args: str, cwd: Path) -> tuple[int, dict[str, Any]]:
    status, out = replay(*args, "--json", cwd=cwd)
    return status, json.loads(out)


@pytest.fixture(scope="module")
def slow_warned(tmp_path_factory: pytest.TempPathFactory) -> Booted:
    """Two ranks, rank 1 four times slower from gate-check on: warned, and ready."""
    db = tmp_path_factory.mktemp("warned") / "j.db"
    return boot(db, "--num-ranks", "2", "--fault", "1:gate-check:slow:4")


@pytest.fixture(scope="module")
def slow_failed(tmp_path_factory: pytest.TempPathFactory) -> Booted:
    """Four ranks (2 CFG x 2 Ulysses), rank 1 four times slower, --on-slow-rank fail. The
    threshold is lowered to 0.5 so that the others' noise on a loaded machine (several boots
    at once) is never taken for slowness: rank 1 measures about 0.2."""
    db = tmp_path_factory.mktemp("failed") / "j.db"
    return boot(db, "--num-ranks", "4", "--cfg-parallel", "2", "--fault",
                "1:gate-check:slow:4", "--on-slow-rank", "fail",
                "--slow-rank-threshold", "0.5")  # fmt: skip


def evidence(doc: dict[str, Any], code: str) -> list[dict[str, Any]]:
    return [item for item in doc["evidence"] if item["code"] == code]


def test_show_names_the_slow_rank_with_its_figures(slow_warned: Booted) -> None:
    """`replay show` lists the host's environment once for both ranks, each rank's probe
    figures, and rank 1's slow finding, warned."""
    status, out = replay("show", slow_warned.run_id, str(slow_warned.db), cwd=slow_warned.db.parent)
    assert status == 0
    hosts = [line for line in out.splitlines() if line.startswith("host ")]
    assert len(hosts) == 1 and "(ranks 0, 1):" in hosts[0]
    assert f"torch {torch.__version__}" in hosts[0]
    rank1 = out.split("\nrank 1 ")[1]
    assert "gate-check probe: compute " in rank1 and "GFLOP/s" in rank1
    assert "links ulysses0 " in rank1
    slow = next(line for line in rank1.splitlines() if "gate-check slow:" in line)
    assert "compute " in slow and "of the median's speed (threshold 0.7), warned" in slow
    rank0 = out.split("\nrank 0 ")[1].split("\nrank 1 ")[0]
    assert "gate-check probe: compute " in rank0 and "gate-check slow" not in rank0


def test_show_json_carries_each_ranks_checks(slow_warned: Booted) -> None:
    """`replay show --json` gives the hosts, and per rank its environment, probe figures and
    slow findings."""
    status, doc = replay_json("show", slow_warned.run_id, str(slow_warned.db),
                              cwd=slow_warned.db.parent)  # fmt: skip
    assert status == 0
    assert [h["ranks"] for h in doc["hosts"]] == [[0, 1]]
    checks = {r["rank"]: r["rank_checks"] for r in doc["ranks"]}
    assert checks[1]["environment"]["torch"] == torch.__version__
    probe = checks[1]["probes"][0]
    assert probe["compute_s"] > 0 and probe["gflops"] > 0
    assert [link["group"] for link in probe["links"]] == ["ulysses0"]
    assert [(s["measure"], s["action"]) for s in checks[1]["slow"]] == [("compute", "warn")]
    assert checks[0]["slow"] == []


def test_diagnose_of_a_warned_slow_rank_is_ready_with_its_slow_rank_item(
    slow_warned: Booted,
) -> None:
    """A warned slow rank leaves the run ready (exit 0); the verdict carries its slow-rank
    item, in the text and in the JSON."""
    assert slow_warned.returncode == 0
    status, doc = replay_json("diagnose", slow_warned.run_id, str(slow_warned.db),
                              cwd=slow_warned.db.parent)  # fmt: skip
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (0, "ready", [])
    [slow] = evidence(doc, "slow-rank")
    assert (slow["rank"], slow["measure"], slow["action"]) == (1, "compute", "warn")
    assert slow["ratio"] < slow["threshold"] == 0.7
    assert "slow at gate-check: compute" in doc["ranks"][1]["note"]
    status, out = replay("diagnose", slow_warned.run_id, str(slow_warned.db),
                         cwd=slow_warned.db.parent)  # fmt: skip
    assert status == 0
    assert "rank 1 slow at gate-check: compute" in out  # the summary
    assert "  rank 1: slow at gate-check: compute" in out  # the checks of the ranks
    assert "(threshold 0.7), warned" in out


def test_a_slow_rank_under_on_slow_rank_fail_is_the_culprit(slow_failed: Booted) -> None:
    """Four ranks, rank 1 slowed and --on-slow-rank fail: the boot exits 1, and diagnose names
    rank 1 in gate-check from its slow-rank item, whichever rank journaled the error first."""
    assert slow_failed.returncode == 1
    status, doc = replay_json("diagnose", slow_failed.run_id, str(slow_failed.db),
                              cwd=slow_failed.db.parent)  # fmt: skip
    assert (status, doc["outcome"]) == (1, "failed")
    assert (doc["culprit_ranks"], doc["culprit_state"]) == ([1], "gate-check")
    [slow] = evidence(doc, "slow-rank")
    assert (slow["rank"], slow["action"], slow["threshold"]) == (1, "fail", 0.5)
    status, out = replay("diagnose", slow_failed.run_id, str(slow_failed.db),
                         cwd=slow_failed.db.parent)  # fmt: skip
    assert "culprit: rank 1 in gate-check" in out
    assert "rank 1: slow at gate-check: compute" in out and "failed the startup" in out


def test_another_torch_on_rank_1_fails_naming_the_field_and_both_values(tmp_path: Path) -> None:
    """Rank 1 reporting torch 2.99.0 fails the startup at gate-check; diagnose names rank 1
    from its environment item, which says torch and both versions, and show lists the two
    environments of the one host apart."""
    booted = boot(tmp_path / "j.db", "--num-ranks", "2",
                  env={"LIFECYCLE_TEST_RANK_ENVIRONMENT": "1:torch=2.99.0"})  # fmt: skip
    assert booted.returncode == 1
    status, doc = replay_json("diagnose", "latest", str(booted.db), cwd=tmp_path)
    assert (status, doc["culprit_ranks"], doc["culprit_state"]) == (1, [1], "gate-check")
    [differs] = evidence(doc, "environment")
    assert (differs["rank"], differs["field"], differs["matters"]) == (1, "torch", True)
    assert (differs["value"], differs["expected"]) == ("2.99.0", torch.__version__)
    _, out = replay("diagnose", "latest", str(booted.db), cwd=tmp_path)
    assert (
        f"rank 1: environment differs: torch 2.99.0 (rank 0: {torch.__version__}),"
        " fails the startup"
    ) in out
    _, shown = replay("show", "latest", str(booted.db), cwd=tmp_path)
    hosts = [line for line in shown.splitlines() if line.startswith("host ")]
    assert [h.split(":", 1)[0].split(" (")[1] for h in hosts] == ["rank 0)", "rank 1)"]
    assert "torch 2.99.0" in hosts[1]


def test_history_gives_each_hosts_probe_figures_run_by_run(
    slow_warned: Booted, slow_failed: Booted
) -> None:
    """`replay history` over both journals lists the host's probe figures per run and rank
    (compute time and speed, each link), oldest run first, in text and JSON."""
    cwd = slow_warned.db.parent
    status, doc = replay_json("history", str(slow_warned.db), str(slow_failed.db), cwd=cwd)
    assert status == 0
    [host] = doc["gate_figures"]
    runs = {run["run_id"]: run for run in host["runs"]}
    assert list(runs) == [slow_warned.run_id, slow_failed.run_id]
    assert [r["rank"] for r in runs[slow_failed.run_id]["ranks"]] == [0, 1, 2, 3]
    warned = {r["rank"]: r for r in runs[slow_warned.run_id]["ranks"]}
    assert warned[1]["gflops"] < warned[0]["gflops"]  # rank 1 was slowed
    assert {link["group"] for link in warned[0]["links"]} == {"ulysses0"}
    failed_links = {link["group"] for r in runs[slow_failed.run_id]["ranks"] for link in r["links"]}
    assert failed_links == {"ulysses0", "ulysses1", "cfg0", "cfg1"}
    status, out = replay("history", str(slow_warned.db), str(slow_failed.db), cwd=cwd)
    block = out.split("gate-check probes per host")[1]
    assert f"{host['host']}  2 run(s)" in block
    assert slow_warned.run_id in block and slow_failed.run_id in block
    assert "GFLOP/s" in block and "ulysses0 " in block and "cfg1 " in block
    assert "newest run: compute " in block and "x the median speed of the 1 run(s)" in block


CUDA_HOST = RankEnvironment(
    host="gpu-a", torch="2.8.0+cu128", cuda="12.8", nccl="2.27.3", driver="570.124.06",
    python="3.11.7", device="NVIDIA H100 80GB HBM3", capability="9.0",
    memory_bytes=85_520_809_984, dtype="bfloat16",
)  # fmt: skip


def straggling_journal(db: Path) -> None:
    """Two CUDA ranks on one host that pass gate-check and serve five requests, rank 1 each
    time entering ulysses0's collectives 9 ms after rank 0."""
    b = JournalBuilder(db, world_size=2)
    link = LinkFigure(group="ulysses0", seconds=4e-5, bytes=262144)
    probed = RankProbed(host="gpu-a", device=CUDA_HOST.device, compute_s=0.0003,
                        compute_flop=2 * 4096**3, links=(link,))  # fmt: skip
    for rank in (0, 1):
        s = b.rank(rank)
        s.walk(0.1, "gate-check")
        s.add(0.2, EnvironmentChecked(environment=CUDA_HOST))
        s.add(0.3, probed)
        s.walk(0.4, "bounded-warm", "ready")
        s.add(1.0, ActionStarted(action="mark-ready"))
        s.add(1.1, ActionFinished(action="mark-ready", duration_s=0.1, ok=True))
        for n in range(5):
            at = 2.0 + n
            s.add(at, RequestStarted(request_id=f"r{n}", source="http",
                                     shape=Shape(width=64, height=64, frames=5), steps=2,
                                     prompt_chars=5))  # fmt: skip
            s.add(at + 0.5, RequestFinished(request_id=f"r{n}", ok=True, total_s=0.5,
                                            checksum=None, peak_bytes=None,
                                            lag_s=0.009 if rank == 1 else 0.0,
                                            lag_group="ulysses0"))  # fmt: skip
    b.close()


def test_a_cuda_host_and_a_straggler_are_shown_and_diagnosed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CUDA host's line names CUDA, NCCL and the driver; the rank late in every request is
    shown and diagnosed as the straggler, with its group and median lag."""
    db = tmp_path / "j.db"
    straggling_journal(db)
    assert main(["show", "latest", str(db)]) == 0
    out = capsys.readouterr().out
    assert (
        "host gpu-a (ranks 0, 1): torch 2.8.0+cu128, CUDA 12.8, NCCL 2.27.3, driver 570.124.06,"
        " python 3.11.7, NVIDIA H100 80GB HBM3 (capability 9.0), 79.65 GiB, dtype bfloat16"
    ) in out
    assert "compute 0.30 ms (458.1 TFLOP/s); links ulysses0 0.040 ms for 256 KiB" in out
    late = "straggler: enters ulysses0's collectives 9.00 ms after its peers, median of the last 5"
    assert late in out.split("\nrank 1 ")[1] and late not in out.split("\nrank 1 ")[0]
    assert main(["diagnose", "latest", str(db), "--json", *AS_WRITTEN]) == 0
    doc = json.loads(capsys.readouterr().out)
    [item] = evidence(doc, "straggler")
    assert (item["rank"], item["group"], item["requests"]) == (1, "ulysses0", 5)
    assert item["median_lag_s"] == pytest.approx(0.009)
    assert "rank 1 straggler: enters ulysses0's collectives 9.00 ms" in doc["summary"]
