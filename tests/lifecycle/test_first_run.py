"""`lifecycle first-run` end to end: the dry run on gloo (this machine has no CUDA device; the
GPU path runs the same steps with --device cuda and has not been run here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import REPO, run_cli

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

ENV = {"PYTHONPATH": str(REPO)}


@pytest.mark.slow
def test_the_dry_run_holds_every_check_and_keeps_what_it_ran(tmp_path: Path) -> None:
    out = tmp_path / "first"
    result = run_cli(
        "lifecycle",
        ["first-run", "--device", "cpu", "--model", "micro-video", "--out", str(out),
         "--dist-timeout", "3"],
        cwd=tmp_path, env=ENV, timeout=420,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["check", "result", "detail"]
    table = lines[2 : lines.index("")]
    results = [line[36:].split("  ")[0] for line in table]
    assert results == ["held"] * 9, result.stdout
    assert table[-1].startswith("time") and "limit 10 min" in table[-1]
    wan = next(line for line in lines if line.startswith("tiny-wan (diffusers)"))
    assert "ready in" in wan and "2 ranks" in wan and "; plan " in wan
    rested = next(line for line in lines if line.startswith("sleep and wake"))
    assert "device memory not measured on cpu" in rested and "reference output matched" in rested
    hang = next(line for line in lines if line.startswith("the field's hang"))
    assert "hung, culprit rank 1 in bounded-warm" in hang
    assert "dry run" in lines[2]
    assert (out / "first-run.db").is_file()
    dumps = sorted(p.name for p in out.rglob("fr_trace_rank_*"))
    assert dumps.count("fr_trace_rank_0") >= 1 and dumps.count("fr_trace_rank_1") >= 1
    assert {p.name for p in out.glob("*.log")} >= {
        "calibrating.log",
        "hang.log",
        "hang-diagnose.log",
        "sleep-wake.log",
    }


def test_asking_for_cuda_where_there_is_none_says_so(tmp_path: Path) -> None:
    result = run_cli(
        "lifecycle", ["first-run", "--out", str(tmp_path / "o")], cwd=tmp_path, env=ENV
    )
    assert result.returncode == 1
    assert "did not hold" in result.stdout and "no CUDA device is visible" in result.stdout
