"""replay on a journal written by a version 1 lifecycle (flat shapes in plan_built,
warmup_record and request_started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from tests.replay.v1_startup import T0, calibrated_plan, write_startup

AS_WRITTEN = ("--now", str(T0 + 10))


@pytest.fixture
def v1_db(tmp_path: Path) -> Path:
    db = tmp_path / "v1.db"
    write_startup(db, run_id="run-v1", as_v1=True)
    return db


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().out


def test_show_prints_the_v1_shapes(v1_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """show names the probe and every warmup by its WxHxF shape."""
    probe = str(calibrated_plan().requests[1].shape)
    status, out = run(capsys, "show", "run-v1", str(v1_db))
    assert status == 0
    assert f"calibration on, probe {probe}" in out
    assert f"warmup probe   {probe} at 4 steps" in out
    assert "warmup bounded 832x480x17 at 4 steps" in out
    status, out = run(capsys, "show", "run-v1", str(v1_db), "--json")
    records = json.loads(out)["ranks"][0]["warmup_records"]
    assert [(r["role"], r["shape"]) for r in records] == [
        ("bounded", "832x480x17"), ("probe", probe), ("rewarm", "832x480x17")
    ]  # fmt: skip


def test_diagnose_finds_the_v1_run_ready(v1_db: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """diagnose judges the version 1 startup a clean one."""
    status, out = run(capsys, "diagnose", "run-v1", str(v1_db), "--json", *AS_WRITTEN)
    assert status == 0, out
    assert json.loads(out)["outcome"] == "ready"


def test_verify_finds_the_v1_plan_matches_today(
    v1_db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify recomputes gates and plan from the version 1 records and finds no divergence."""
    status, out = run(capsys, "verify", "run-v1", str(v1_db), "--json")
    (report,) = json.loads(out)
    assert status == 0, report
    assert report["consistent"] and "rank 0 plan" in report["checked"]


def test_diff_of_a_v1_and_a_v2_run_sees_the_same_warmups(
    v1_db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A version 1 run and the same startup written today diff to the same warmup lines."""
    v2_db = tmp_path / "v2.db"
    write_startup(v2_db, run_id="run-v2", as_v1=False)
    status, out = run(
        capsys, "diff", "run-v1", "run-v2", str(v1_db), str(v2_db), "--json", *AS_WRITTEN
    )
    assert status == 0
    doc = json.loads(out)
    assert doc["a"]["warmup"] == doc["b"]["warmup"]
    assert [w["shape"] for w in doc["a"]["warmup"]] == [
        str(r.shape) for r in calibrated_plan().requests
    ]
