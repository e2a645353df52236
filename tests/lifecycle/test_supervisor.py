"""The launcher's ranks and its summary of them: ranks run the launcher's lifecycle, never a
folder's of the same name; exit statuses in words, and the boot's verdict."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.store import Journal
from lifecycle.testing.journals import T0, JournalBuilder, a2a, beat
from lifecycle.verdict.launched import (
    LaunchedRun,
    exit_text,
    failure_reason,
    launched_verdict,
    summary_lines,
)
from tests.conftest import Completed
from tests.replay.scenarios import BEFORE_READY, aborted, error, hung_in_drop_buffers


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        (None, "running"),
        (0, "exit 0"),
        (1, "exit 1"),
        (3, "exit 3"),
        (-9, "killed by SIGKILL"),
        (-6, "killed by SIGABRT"),
        (143, "stopped by SIGTERM (143)"),
        (130, "stopped by SIGINT (130)"),
        (255, "exit 255"),
    ],
)
def test_an_exit_status_reads_one_way(code: int | None, shown: str) -> None:
    """A rank's exit status reads as `exit N`, `killed by SIGNAL` (a signal it did not handle)
    or `stopped by SIGNAL (128+N)` (a stop it journaled), wherever it is shown."""
    assert exit_text(code) == shown


@pytest.mark.ranks
def test_ranks_never_import_a_lifecycle_folder_of_the_working_directory(tmp_path: Path) -> None:
    """Booted from a directory holding a `lifecycle/` package of its own (a checkout), by a
    launcher that runs the installed lifecycle, two ranks get to ready on the same lifecycle:
    the folder's package is never imported (it would leave a marker and fail)."""
    decoy = tmp_path / "lifecycle"
    decoy.mkdir()
    marker = tmp_path / "decoy-imported"
    (decoy / "__init__.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported\\n')\n"
        "raise SystemExit('the working directory\\'s lifecycle was imported')\n"
    )
    launched = subprocess.run(
        [sys.executable, "-P", "-m", "lifecycle", "boot", "--model", "micro-video",
         "--num-ranks", "2", "--warmup-mode", "none", "--db", "j.db"],
        cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"},
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stdout[-2000:] + launched.stderr[-2000:]
    assert "startup to ready" in launched.stdout
    assert not marker.exists()


@pytest.mark.ranks
def test_a_rank_failing_at_ready_fails_the_boot_and_its_summary_says_so(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """With rank 1 failing on entering ready while rank 0 gets there, `boot` exits 1, prints
    no "startup to ready" line, shows each rank's exit status in words, and ends on a line
    that gives the exit status and the failure."""
    result = lifecycle_cli(
        "boot", "--db", "j.db", "--model", "micro-video", "--warmup-mode", "none",
        "--num-ranks", "2", "--dist-timeout", "3", "--fault", "1:ready:raise",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "startup to ready" not in result.stdout, result.stdout
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "boot: exit 1: rank 1 failed in ready", lines[-3:]
    assert lines[-3].startswith("rank 0: stopped") and lines[-3].endswith("; exit 0"), lines
    assert lines[-2].startswith("rank 1: failed"), lines
    # The failed rank exits on its own (it lingers only under --on-peer-failure wait).
    assert "; exit 1; InjectedFault: " in lines[-2], lines


def folded(db: Path) -> dict[int, RankView]:
    """Each rank's view of the journal's one run, folded from its events as the launcher
    folds them while it follows its ranks."""
    journal = Journal.open_for_read(str(db))
    try:
        (run,) = journal.runs()
        folds = {r: RankFold(run_id=run.run_id, rank=r) for r in range(run.world_size)}
        for stored in journal.read(run_id=run.run_id):
            folds[stored.rank].apply(stored)
    finally:
        journal.close()
    return {rank: fold.view() for rank, fold in folds.items()}


def boot_reason(db: Path, codes: list[int | None]) -> str | None:
    """What the launcher's last line gives as the reason, its ranks having left with `codes`."""
    views = folded(db)
    run = LaunchedRun(
        run_id="run-hand-built",
        created_at=T0,
        world_size=len(codes),
        config=args_to_json(ServerArgs()),
    )
    return failure_reason(launched_verdict(run, views, codes, now=T0 + 60), views, codes)


def test_the_last_line_names_the_rank_that_hung_not_the_victim_whose_wait_timed_out(
    tmp_path: Path,
) -> None:
    """Four ranks, rank 2 hung in drop-buffers: rank 3 failed first (its all-to-all with rank
    2 timed out) and the others were aborted, yet the boot's reason leads with rank 2 in
    drop-buffers, the culprit `replay diagnose` names, and tells the victims after it."""
    b = JournalBuilder(tmp_path / "j.db", world_size=4)
    hung_in_drop_buffers(b)
    b.close()
    assert boot_reason(tmp_path / "j.db", [1, 1, 1, 1]) == (
        "rank 2 hung in drop-buffers; then rank 3 failed in ready;"
        " rank 0, 1 aborted (the agreed abort)"
    )


def a_forged_message_dropped_then_a_peers_raise(b: JournalBuilder) -> None:
    """Rank 0 drops a message that failed the run key's check (a non-fatal error), then rank
    1 raises in probe and the agreed abort stops rank 0."""
    for rank in (0, 1):
        b.rank(rank).walk(0.1, *BEFORE_READY[:3])
        b.rank(rank).add(1.0, beat())
    b.rank(0).add(1.1, error("unauthenticated-message", "abort slot: not sealed with the run key",
                             "UnauthenticatedMessage", fatal=False))  # fmt: skip
    b.rank(0).add(1.5, a2a("world", 0))
    raised = error("injected-fault", "raised in probe", "InjectedFault")
    b.rank(1).add(1.6, raised)
    b.rank(1).walk(1.7, "failed")
    b.rank(0).add(1.8, aborted(by=1, error_type=raised.error_type, kind=raised.error_kind,
                               message=raised.message, state="probe"))  # fmt: skip
    b.rank(0).walk(1.9, "failed")


def test_a_dropped_forgery_does_not_make_an_aborted_rank_a_failed_one(tmp_path: Path) -> None:
    """A rank that journaled only a non-fatal error (a dropped unauthenticated message)
    before the agreed abort stopped it is aborted, in its summary line and in the reason,
    and its line shows no error: only fatal errors fail a rank."""
    b = JournalBuilder(tmp_path / "j.db")
    a_forged_message_dropped_then_a_peers_raise(b)
    b.close()
    lines = summary_lines(folded(tmp_path / "j.db"), [1, 1], created_at=T0)
    assert lines[0] == "rank 0: aborted (rank 1 failed) never ready; exit 1", lines
    assert lines[1] == "rank 1: failed       never ready; exit 1; InjectedFault: raised in probe"
    assert boot_reason(tmp_path / "j.db", [1, 1]) == (
        "rank 1 failed in probe; then rank 0 aborted (the agreed abort)"
    )
