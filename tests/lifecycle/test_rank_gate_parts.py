"""The check of the ranks' parts that run without a group (docs/ranks.md): the test hook that
makes a rank report another environment, and NCCL's own diagnostics, whose environment and
report are read here on CPU (NCCL itself, which writes the report, needs a GPU: not run here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lifecycle.core.decisions.rankcheck import TEST_ENVIRONMENT_ENV, as_told
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.kinds.rankevents import RankEnvironment
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.group.gatecheck import DIAGNOSTICS_CHARS, nccl_diagnostics_env, nccl_report

FOUND = RankEnvironment(
    host="node-1", torch="2.13.0", cuda="", nccl="", driver="", python="3.11.7", device="cpu",
    capability="avx2", memory_bytes=2**34, dtype="float32",
)  # fmt: skip


def test_the_hook_tells_one_rank_another_environment() -> None:
    """`RANK:FIELD=VALUE,...`: the rank named reports the values told, every other rank what it
    found; a size is a number."""
    told = "1:torch=9.9,1:memory_bytes=1024,0:nccl=2.31.0"
    one = as_told(FOUND, rank=1, text=told)
    assert (one.torch, one.memory_bytes, one.nccl) == ("9.9", 1024, "")
    assert as_told(FOUND, rank=2, text=told) == FOUND


@pytest.mark.parametrize(
    ("told", "said"),
    [
        ("1:torhc=9.9", "no field 'torhc'"),
        ("1:memory_bytes=abc", "memory_bytes is a number"),
    ],
)
def test_the_hook_refuses_what_is_not_a_field_or_a_size(told: str, said: str) -> None:
    """A field the hook names that a rank's environment lacks, or a size that is not a number,
    is refused naming the hook, on every rank (not only the one named), not ignored."""
    for rank in (0, 1):
        with pytest.raises(ConfigError) as refused:
            as_told(FOUND, rank=rank, text=told)
        assert TEST_ENVIRONMENT_ENV in str(refused.value) and said in str(refused.value)


def _args(diagnostics: bool) -> ServerArgs:
    return ServerArgs(model=MODEL_PRESETS["micro-video"], nccl_diagnostics=diagnostics)


def test_nccl_diagnostics_are_turned_on_for_the_ranks_communicators_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--nccl-diagnostics sets NCCL 2.31's two diagnostics, NCCL's log at INFO unless the
    operator chose a level, and a log file of the rank's own per process; without it, nothing."""
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    assert nccl_diagnostics_env(_args(False), folder=tmp_path, rank=1) == {}
    env = nccl_diagnostics_env(_args(True), folder=tmp_path, rank=1)
    assert env == {
        "NCCL_RUN_DIAGNOSTICS": "1",
        "NCCL_RUN_RAS_DIAGNOSTICS": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_FILE": str(tmp_path / "nccl-diagnostics.rank1.%p.log"),
    }
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    assert nccl_diagnostics_env(_args(True), folder=tmp_path, rank=1)["NCCL_DEBUG"] == "WARN"


def test_the_nccl_report_keeps_the_diagnostics_lines_of_this_process_cut_to_its_limit(
    tmp_path: Path,
) -> None:
    """The report is read from this process's own log file (NCCL's `%p`), keeps the lines that
    speak of diagnostics or RAS, and its last DIAGNOSTICS_CHARS characters; None when the
    diagnostics are off, or NCCL wrote nothing."""
    env = nccl_diagnostics_env(_args(True), folder=tmp_path, rank=0)
    assert nccl_report(_args(True), env) is None  # nothing written yet
    log = tmp_path / f"nccl-diagnostics.rank0.{os.getpid()}.log"
    log.write_text(
        "host:1:1 NCCL INFO Bootstrap : Using eth0\n"
        "host:1:1 NCCL INFO Diagnostics: path rank 0 -> rank 1 ok, 23.1 GB/s\n"
        "host:1:1 NCCL INFO RAS: peers 2 of 2 reachable\n"
    )
    report = nccl_report(_args(True), env)
    assert report == (
        "host:1:1 NCCL INFO Diagnostics: path rank 0 -> rank 1 ok, 23.1 GB/s\n"
        "host:1:1 NCCL INFO RAS: peers 2 of 2 reachable"
    )
    assert nccl_report(_args(False), env) is None
    log.write_text("RAS: " + "x" * (2 * DIAGNOSTICS_CHARS) + "end\n")
    long = nccl_report(_args(True), env)
    assert long is not None and len(long) == DIAGNOSTICS_CHARS and long.endswith("end")
