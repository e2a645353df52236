"""PyTorch's Flight Recorder joined with the journal, on real dumps: two gloo ranks with
TORCH_FR_BUFFER_SIZE set, a plug-in pipeline whose own all-reduce (on the default group, never
recorded by the lifecycle) rank 1 enters while rank 0 is stuck before it, the dumps the ranks
write themselves, and `replay` reading them, bad ones included."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from lifecycle.core.format import safepickle
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from tests.conftest import REPO, Completed, run_cli

if TYPE_CHECKING:
    from lifecycle.core.settings.modelspec import ModelSpec
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline import Pipeline

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

ENV = {"PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
TP_SPEC = dataclasses.replace(
    MODEL_PRESETS["micro-video"], name="tp-video", declares_residency=False
)
# Rank 0's pipeline stops before its all-reduce this long at most (the launcher ends it
# sooner, once rank 1 has failed): a rank stuck in its own code, not in a collective.
STUCK_S = 90.0
DIST_TIMEOUT_S = 3


def tp_factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    """micro-video with a tensor-parallel all-reduce of its own on the default group, which
    the lifecycle never records; rank 0 gets stuck before its first one."""
    import torch
    import torch.distributed as dist

    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

    class TensorParallel(TinyVideoPipeline):
        def denoise(self, *args: Any, **kwargs: Any) -> Any:
            if dist.get_rank() == 0:
                threading.Event().wait(STUCK_S)
            dist.all_reduce(torch.ones(8))
            return super().denoise(*args, **kwargs)

    return TensorParallel(TP_SPEC, comm=comm)


TP = (TP_SPEC, tp_factory)


@dataclass(frozen=True)
class Hung:
    db: Path
    dumps: Path  # the run's folder of dumps
    run_id: str
    boot: Completed


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory) -> Hung:
    cwd = tmp_path_factory.mktemp("flight")
    db = cwd / "lifecycle.db"
    boot = run_cli(
        "lifecycle",
        # --pipeline alone selects the plug-in's model (tp-video).
        ["boot", "--pipeline", "tests.replay.test_flight_recorder:TP",
         "--num-ranks", "2", "--cfg-parallel", "2", "--dist-timeout", str(DIST_TIMEOUT_S),
         "--state-deadline", "1.5", "--startup-timeout", "60", "--heartbeat-interval", "0.2",
         "--flight-recorder", "500", "--db", str(db), "--log-level", "error"],
        cwd=cwd, env=ENV, timeout=180,
    )  # fmt: skip
    with sqlite3.connect(db) as conn:
        (run_id,) = conn.execute("SELECT run_id FROM runs").fetchone()
    return Hung(
        db=db, dumps=cwd / "lifecycle.db.flight-recorder" / run_id, run_id=run_id, boot=boot
    )


def replay(cwd: Path, *args: str) -> Completed:
    result = run_cli("replay", args, cwd=cwd, env=ENV, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def journaled_dumps(db: Path) -> list[tuple[int, dict[str, Any]]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT rank, data FROM events WHERE kind = 'flight_recorder_dumped' ORDER BY seq"
        ).fetchall()
    return [(int(rank), json.loads(data)) for rank, data in rows]


def test_ranks_dump_the_flight_recorder_on_trouble_and_journal_where(hung: Hung) -> None:
    assert hung.boot.returncode == 1, hung.boot.stderr
    dumped = journaled_dumps(hung.db)
    reasons = {(rank, d["reason"]) for rank, d in dumped}
    assert (0, "stall") in reasons and (1, "stall") in reasons
    assert any(rank == 1 and reason not in ("stall", "signal") for rank, reason in reasons)
    for rank, d in dumped:
        assert d["error"] is None
        assert d["path"] == str(hung.dumps / f"fr_trace_rank_{rank}")
        assert d["entries"] > 0 and d["bytes"] > 0
        assert {"group": "world", "torch_name": "0"} in d["groups"]
    # A dump cut short by the launcher's SIGKILL leaves only its `.part`, which replay skips.
    written = sorted(p.name for p in hung.dumps.iterdir() if not p.name.endswith(".part"))
    assert written == ["fr_trace_rank_0", "fr_trace_rank_1"]


def test_dist_timeout_bounds_the_default_group_a_pipeline_uses(hung: Hung) -> None:
    """Rank 1's own all-reduce timed out after --dist-timeout, not the rendezvous's 120 s."""
    with sqlite3.connect(hung.db) as conn:
        (data,) = conn.execute(
            "SELECT data FROM events WHERE kind = 'error' AND rank = 1 ORDER BY seq"
        ).fetchone()
    error = json.loads(data)
    assert f"{DIST_TIMEOUT_S * 1000}ms" in error["message"]
    # Raised by torch.distributed outside the recorder, and classified when recorded as the
    # recorder's own timeouts are.
    assert (error["error_type"], error["error_kind"]) == ("RuntimeError", "collective-timeout")


def test_diagnose_names_the_collective_only_the_flight_recorder_saw(hung: Hung) -> None:
    result = replay(hung.db.parent, "diagnose", "latest", str(hung.db), "--json")
    assert result.returncode == 1, result.stderr
    doc = json.loads(result.stdout)
    assert doc["outcome"] == "hung"
    assert doc["culprit_ranks"] == [0] and doc["culprit_state"] == "bounded-warm"
    (stuck,) = doc["flight_recorder"]["stuck"]
    assert stuck["rank"] == 1 and stuck["waiting_for"] == [0]
    assert stuck["op"] == "all_reduce" and stuck["process_group"] == "default_pg"
    assert stuck["state"] == "bounded-warm" and stuck["recorded"] is False
    assert stuck["caller"].startswith("test_flight_recorder.py:")
    blocked = [e for e in doc["evidence"] if e["code"] == "blocked"]
    assert blocked and blocked[0]["rank"] == 1 and blocked[0]["from_flight_recorder"] is True
    assert blocked[0]["group_seq"] == stuck["seq"] and blocked[0]["ended"] == "timed-out"
    assert blocked[0]["waiting_for"] == [0] and blocked[0]["state"] == "bounded-warm"
    assert {r["rank"]: r["status"] for r in doc["ranks"]} == {0: "hung", 1: "failed"}

    text = replay(hung.db.parent, "diagnose", "latest", str(hung.db)).stdout
    assert "culprit: rank 0 in bounded-warm" in text
    assert f"all_reduce #{stuck['seq']} of default_pg" in text
    assert "seen only by PyTorch's Flight Recorder" in text


def test_without_the_dumps_no_collective_is_named(hung: Hung, tmp_path: Path) -> None:
    """What the Flight Recorder adds: without it, the journal holds rank 1's timeout and no
    collective it was in."""
    empty = tmp_path / "none"
    empty.mkdir()
    doc = json.loads(
        replay(
            hung.db.parent, "diagnose", "latest", str(hung.db), "--json",
            "--flight-recorder", str(empty),
        ).stdout
    )  # fmt: skip
    assert doc["flight_recorder"]["stuck"] == []
    assert not [e for e in doc["evidence"] if e["code"] == "blocked"]
    assert [r["pending_collective"] for r in doc["ranks"]] == [None, None]


def test_a_folder_given_is_read_and_show_and_trace_use_it(hung: Hung, tmp_path: Path) -> None:
    moved = tmp_path / "elsewhere"
    shutil.copytree(hung.dumps, moved / hung.run_id)
    doc = json.loads(
        replay(
            tmp_path, "diagnose", hung.run_id, str(hung.db), "--json", "--flight-recorder",
            str(moved),
        ).stdout
    )  # fmt: skip
    assert doc["culprit_ranks"] == [0]
    assert doc["flight_recorder"]["files"]["1"] == [str(moved / hung.run_id / "fr_trace_rank_1")]

    shown = replay(tmp_path, "show", hung.run_id, str(hung.db), "--flight-recorder", str(moved))
    assert "flight recorder (fr_trace_rank_1)" in shown.stdout
    assert "never finished: a peer never entered it" in shown.stdout
    doc = json.loads(
        replay(
            tmp_path, "show", hung.run_id, str(hung.db), "--json", "--flight-recorder", str(moved)
        ).stdout
    )
    last = doc["flight_recorder"]["1"][-1]
    assert last["state"] == "bounded-warm" and last["op"] == "all_reduce"
    assert last["finished"] is False and last["input_sizes"] == [[8]]
    assert {e["state"] for e in doc["flight_recorder"]["0"]} <= {"created", "gate-check"}

    out = tmp_path / "trace.json"
    replay(tmp_path, "trace", hung.run_id, str(hung.db), "-o", str(out))
    events = json.loads(out.read_text())["traceEvents"]
    flight = [e for e in events if e.get("tid") == 5 and e["ph"] != "M"]
    assert {e["pid"] for e in flight} == {0, 1}
    stuck = [e for e in flight if e["args"]["never_finished"]]
    assert len(stuck) == 1 and stuck[0]["pid"] == 1 and stuck[0]["ph"] == "X"
    assert stuck[0]["args"]["state"] == "bounded-warm"


class _RunsCode:
    """Unpickling this would run a command that leaves a file behind."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (shutil.copyfile, (__file__, str(self.marker)))


def _bad_dumps(real: bytes, marker: Path) -> dict[str, bytes]:
    dump = safepickle.loads(real)
    newer = {**dump, "version": "3.0"}
    return {
        "truncated": real[: len(real) // 2],
        "foreign": json.dumps({"hello": "world"}).encode(),
        "runs-code": pickle.dumps({"version": "2.10", "entries": [_RunsCode(marker)]}),
        "newer": pickle.dumps(newer, protocol=2),
        "text": b"rank 1 said nothing\n",
    }


@pytest.mark.parametrize("kind", ["truncated", "foreign", "runs-code", "newer", "text"])
def test_a_bad_dump_is_one_line_and_the_verdict_goes_on_without_it(
    hung: Hung, tmp_path: Path, kind: str
) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "dumps"
    folder.mkdir()
    real = (hung.dumps / "fr_trace_rank_1").read_bytes()
    (folder / "fr_trace_rank_1").write_bytes(_bad_dumps(real, marker)[kind])
    shutil.copy(hung.dumps / "fr_trace_rank_0", folder / "fr_trace_rank_0")
    result = replay(
        tmp_path, "diagnose", "latest", str(hung.db), "--json", "--flight-recorder", str(folder)
    )
    assert not marker.exists()
    warnings = [line for line in result.stderr.splitlines() if "fr_trace_rank_1" in line]
    assert len(warnings) == 1 and warnings[0].startswith("replay: warning: flight recorder: ")
    doc = json.loads(result.stdout)
    assert doc["flight_recorder"]["ranks"] == [0] and doc["flight_recorder"]["stuck"] == []
    assert doc["outcome"] in ("failed", "hung") and result.returncode == 1
    if kind == "newer":
        assert "version 3.0" in warnings[0]
    if kind == "runs-code":
        assert "refused" in warnings[0]


def test_a_flight_recorder_folder_that_is_not_there_is_a_usage_error(hung: Hung) -> None:
    result = replay(
        hung.db.parent, "diagnose", "latest", str(hung.db), "--flight-recorder", "/no/such/dir"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "replay: error: --flight-recorder /no/such/dir: no such folder"
