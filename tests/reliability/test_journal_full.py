"""A journal that cannot be written: the rank stops, says so in one line, and exits 3."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.core.errors import JournalError
from lifecycle.store.journal import Journal
from tests.conftest import Completed, one_clear_line, run_cli
from tests.support.interpreter import run_python

pytestmark = [pytest.mark.usefixtures("no_leftover_processes")]

MICRO = ["--model", "micro-video", "--log-level", "error", "--heartbeat-interval", "0.2"]
# Room for the new journal's tables and its first few events, not for a whole startup: past
# it, every write to the journal (or its -wal file) fails with EFBIG, as on a full disk.
FILE_SIZE_LIMIT = 96 * 1024
EXEC_WITH_FILE_SIZE_LIMIT = (
    "import os, resource, sys; limit = int(sys.argv[1]);"
    " resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit));"
    " os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def boot_with_file_size_limit(cwd: Path, limit: int, *args: str) -> Completed:
    """`lifecycle boot ARGS` under RLIMIT_FSIZE (inherited by its rank processes)."""
    proc = run_python(
        EXEC_WITH_FILE_SIZE_LIMIT, str(limit), "-m", "lifecycle", "boot", *args, cwd=cwd,
        env={"PYTHONWARNINGS": "ignore"}, timeout=180,
    )  # fmt: skip
    return Completed(proc.returncode, proc.stdout, proc.stderr)


@contextlib.contextmanager
def nearly_full_disk(directory: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs at `directory` with about 256 KiB left (room for the schema and a few
    events, not a startup); unmounted afterwards."""
    directory.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the file-size-limit case covers a failed write")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(directory)],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(
            "mounting a tmpfs needs root with CAP_SYS_ADMIN"
            f" ({mounted.stderr.strip()}); the file-size-limit case covers a failed write"
        )
    try:
        (directory / "filler").write_bytes(b"\0" * (2 * 1024 * 1024 - 256 * 1024))
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True, timeout=30)


def replay_runs(cwd: Path, db: Path) -> list[dict[str, object]]:
    result = run_cli("replay", ["runs", str(db), "--json"], cwd=cwd, timeout=60)
    assert result.returncode == 0, result.stderr
    runs: list[dict[str, object]] = json.loads(result.stdout)
    return runs


@pytest.mark.parametrize("cause", ["file-size-limit", "full-disk"])
def test_a_journal_that_cannot_grow_stops_a_one_rank_boot_with_exit_3(
    tmp_path: Path, cause: str
) -> None:
    """A write to the journal fails mid-startup (RLIMIT_FSIZE, or a nearly full tmpfs): one
    line naming the journal and the reason, exit 3, and what was written before still reads."""
    if cause == "full-disk":
        with nearly_full_disk(tmp_path / "disk") as disk:
            result = run_cli(
                "lifecycle", ["boot", *MICRO, "--db", str(disk / "j.db")], cwd=tmp_path
            )
            line = one_clear_line(result)
            assert line == (
                f"lifecycle: error: journal {disk / 'j.db'} could not be written:"
                " database or disk is full"
            )
            runs = replay_runs(tmp_path, disk / "j.db")
    else:
        result = boot_with_file_size_limit(tmp_path, FILE_SIZE_LIMIT, *MICRO, "--db", "j.db")
        line = one_clear_line(result)
        assert line.startswith("lifecycle: error: journal j.db could not be written: "), line
        runs = replay_runs(tmp_path, tmp_path / "j.db")
    assert result.returncode == 3
    assert [run["outcome"] for run in runs] != ["ready"]


def test_a_hung_rank_whose_journal_fills_is_stopped_by_its_heartbeat(tmp_path: Path) -> None:
    """The main thread hangs in gate-check; the heartbeats fill the journal until one cannot
    be written: the heartbeat thread stops the rank with one line and exit 3."""
    result = boot_with_file_size_limit(
        tmp_path, FILE_SIZE_LIMIT, *MICRO, "--db", "j.db", "--fault", "0:gate-check:hang"
    )
    assert result.returncode == 3
    assert one_clear_line(result).startswith("lifecycle: error: journal j.db could not be written")
    assert "fault injected: 0:gate-check:hang" in result.stdout


def wait_for_event(db: Path, kind: str, *, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        # Not there yet, or its tables not yet: looked at again until the deadline.
        with (
            contextlib.suppress(JournalError),
            contextlib.closing(Journal.open_for_read(str(db))) as journal,
        ):
            if any(stored.kind == kind for stored in journal.read()):
                return
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event in {db} within {within_s} s")


def test_a_shutdown_that_cannot_be_journaled_exits_3_in_one_line(tmp_path: Path) -> None:
    """SIGTERM to a hung rank whose journal stopped growing after the hang began: the shutdown
    record cannot be written, so the rank says so in one line and exits 3 (no traceback in
    the signal thread, no rank left running)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video", "--db", "j.db",
         "--log-level", "error", "--heartbeat-interval", "3600", "--fault", "0:gate-check:hang"],
        cwd=tmp_path, env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_event(tmp_path / "j.db", "fault_injected", within_s=60)
        resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1024, 1024))
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    result = Completed(proc.returncode, stdout, stderr)
    assert result.returncode == 3
    assert one_clear_line(result).startswith("lifecycle: error: journal j.db could not be written")


@pytest.mark.ranks
def test_ranks_that_cannot_write_the_journal_stop_and_the_launcher_says_so(
    tmp_path: Path,
) -> None:
    """Two ranks on a journal that stops growing: the rank that meets the full journal says
    so, the launcher names the journal and the rank and exits 3. The other rank either meets
    the full journal too or, when it was still agreeing on a run id as the first failed, is
    stopped by the launcher's agreed abort and says that it journaled nothing: which of the
    two happens is a matter of timing, and both are right."""
    result = boot_with_file_size_limit(
        tmp_path, 96 * 1024, *MICRO, "--db", "j.db", "--num-ranks", "2", "--dist-timeout", "5"
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("lifecycle: error: journal j.db could not be written by rank")
    assert lines[-1].endswith("the startup stopped and its record is incomplete")
    stopped_unjournaled = re.compile(
        r"lifecycle: rank \d: stopped by SIGTERM before its journal was open .*: nothing journaled"
    )
    assert all(
        line.startswith("lifecycle: error: ") or stopped_unjournaled.fullmatch(line)
        for line in lines
    ), result.stderr
    assert sum("could not be written" in line for line in lines) >= 2, result.stderr
    assert "exit 3" in result.stdout


def test_boot_help_documents_exit_3(tmp_path: Path) -> None:
    """`lifecycle boot --help` lists the exit statuses, 3 among them."""
    result = run_cli("lifecycle", ["boot", "--help"], cwd=tmp_path, timeout=60)
    assert result.returncode == 0
    assert "3    the journal could not be written" in result.stdout
