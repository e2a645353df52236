"""`lifecycle first-run` prints each row of its table when that check is done, in columns fixed
before the first one runs."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.serve.cli.firstrun import NAME_WIDTH, RESULT_WIDTH
from tests.conftest import processes_in, wait_until

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


def test_each_row_is_printed_when_its_check_is_done(tmp_path: Path) -> None:
    """The header, the rule and the devices row come at once; the first boot's row comes while
    the later checks still run; every row's result is in the same column."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", "first-run", "--device", "cpu", "--model",
         "micro-video", "--out", str(tmp_path / "first"), "--dist-timeout", "3"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.stdout is not None
    lines: list[str] = []
    pending = b""
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and not any(
            line.startswith("boot 1 rank, calibrating") for line in lines
        ):
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            *done, pending = (pending + chunk).split(b"\n")
            lines.extend(line.decode() for line in done)
        still_running = proc.poll() is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        proc.stdout.close()
        # The ranks of the boot first-run had started run in sessions of their own, which the
        # SIGKILL does not reach: they leave on their own once the rendezvous store their
        # launcher hosted is gone (a loaded machine may take a few seconds).
        wait_until(lambda: not processes_in(tmp_path), within=30, what="the ranks leaving")
    assert still_running, lines
    header, rule, devices, boot = lines[:4]
    assert header.split() == ["check", "result", "detail"]
    assert rule.split()[:2] == ["-" * NAME_WIDTH, "-" * RESULT_WIDTH]
    column = NAME_WIDTH + 2
    for row in (header, devices, boot):
        assert row[column - 2 : column] == "  " and row[column] != " ", row
    assert devices.startswith("devices") and devices[column:].startswith("held")
    assert boot.startswith("boot 1 rank, calibrating") and boot[column:].startswith("held")
    assert "ready in" in boot
