"""replay's colour and alignment: coloured cells keep their colour, columns line up by display
width, and journal text never carries an escape sequence to the terminal."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from wcwidth import wcswidth

from lifecycle.core.format.events import Error, RunStarted
from lifecycle.testing.journals import AS_WRITTEN, T0, JournalBuilder
from replay.views.render import Style, table
from replay.views.runs import RunSummary, format_runs
from tests.conftest import REPO

# The styling replay itself adds: Select Graphic Rendition sequences, nothing else.
SGR = re.compile(r"\x1b\[[0-9;]*m")
WIDE_HOST = "主机-東京"
HOSTILE_TYPE = "Boom\x1b]0;pwned\x07"
HOSTILE_MESSAGE = "\x1b[31mred\x1b[0m\x1b[2J 错误 text"


def column_offsets(line: str, texts: list[str]) -> list[int]:
    """The display column at which each of `texts` starts in `line`, searched left to right."""
    offsets, at = [], 0
    for text in texts:
        at = line.index(text, at)
        offsets.append(wcswidth(line[:at]))
        at += len(text)
    return offsets


def summary(run_id: str, host: str, outcome: str) -> RunSummary:
    return RunSummary(run_id=run_id, started=T0, host=host, world_size=2, mode="auto",
                      path="bounded", skip_reason=None, outcome=outcome,
                      startup_to_ready_s=None, command=None)  # fmt: skip


def test_a_coloured_cell_keeps_its_colour_and_wide_cells_align() -> None:
    """With colour on, the outcome column is coloured and every column starts at the same
    display offset on every line, wide (CJK) characters included."""
    runs = [summary("run-a", WIDE_HOST, "failed"), summary("run-b", "node-7", "ready")]
    shown = format_runs(runs, Style(color=True))
    assert "\x1b[31mfailed\x1b[0m" in shown and "\x1b[32mready\x1b[0m" in shown
    lines = SGR.sub("", shown).splitlines()
    header = column_offsets(lines[0], ["run", "host", "ranks", "outcome"])
    assert column_offsets(lines[2], ["run-a", WIDE_HOST, "2", "failed"]) == header
    assert column_offsets(lines[3], ["run-b", "node-7", "2", "ready"]) == header


def test_columns_align_by_display_width_in_any_cell() -> None:
    """A wide-character cell in the middle of a row pushes no later column out of line."""
    style = Style(color=True)
    rows = [["错误信息", style.cell("x", "31"), "end"], ["ascii", style.cell("yy", "32"), "end"]]
    lines = SGR.sub("", table(["what", "mark", "tail"], rows)).splitlines()
    ends = {wcswidth(line[: line.rindex("end")]) for line in lines[2:]}
    assert len(ends) == 1
    assert wcswidth(lines[0][: lines[0].index("tail")]) in ends


def test_colour_off_prints_no_escape_sequence() -> None:
    """Style(color=False): the same table with no escape sequence at all."""
    shown = format_runs([summary("run-a", WIDE_HOST, "failed")], Style(color=False))
    assert "\x1b" not in shown and "failed" in shown


def test_escape_sequences_in_journal_text_are_cleaned_before_styling() -> None:
    """Journal text in a plain cell or a styled one loses its escape sequences; the only ones
    left are the styling replay adds."""
    style = Style(color=True)
    shown = table(["error", "outcome"], [[HOSTILE_MESSAGE, style.cell(HOSTILE_TYPE, "31")]])
    assert SGR.findall(shown) == ["\x1b[31m", "\x1b[0m"]
    assert "\x07" not in SGR.sub("", shown) and "\x1b" not in SGR.sub("", shown)
    assert "red 错误 text" in shown


def two_runs(db: Path) -> None:
    """A journal with a run on a host of wide characters that fails with an error full of
    escape sequences, and a run that is still starting."""

    def started(host: str) -> RunStarted:
        return RunStarted(world_size=1, host=host, pid=1, lifecycle_version="0.1.0",
                          torch_version=None, python_version="3.11", device="cpu",
                          dist_backend=None)  # fmt: skip

    failing = JournalBuilder(db, run_id="run-failed", world_size=1)
    failing.rank(0).add(0.0, started(WIDE_HOST))
    failing.rank(0).walk(0.1, "gate-check")
    failing.rank(0).add(0.5, Error(error_type=HOSTILE_TYPE, error_kind="exception",
                                   message=HOSTILE_MESSAGE, traceback="", trigger=None,
                                   fatal=True))  # fmt: skip
    failing.rank(0).walk(0.6, "failed")
    failing.close()
    starting = JournalBuilder(db, run_id="run-starting", world_size=1)
    starting.rank(0).add(0.0, started("node-7"))
    starting.rank(0).walk(0.1, "gate-check", "bounded-warm")
    starting.close()


def on_terminal(args: list[str], cwd: Path, *, no_color: bool) -> tuple[int, str]:
    """`replay ARGS` with its output on a pseudo-terminal: its exit status and what it wrote."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    env.update({"PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)})
    if no_color:
        env["NO_COLOR"] = "1"
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "replay", *args], cwd=cwd, env=env,
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)  # fmt: skip
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not chunk:
                    break
                chunks.append(chunk)
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(leader)
    return status, b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.parametrize("no_color", [False, True])
def test_runs_and_diagnose_on_a_terminal(tmp_path: Path, no_color: bool) -> None:
    """On a terminal: the outcome coloured (none with NO_COLOR), the host of wide characters in
    line with the others, and no escape sequence from the journal."""
    two_runs(tmp_path / "j.db")
    status, listed = on_terminal(["runs", "j.db", *AS_WRITTEN], tmp_path, no_color=no_color)
    assert status == 0, listed
    if no_color:
        assert "\x1b" not in listed
    else:
        assert "\x1b[31mfailed\x1b[0m" in listed
    lines = SGR.sub("", listed).splitlines()
    header = column_offsets(lines[0], ["run", "host", "ranks", "outcome"])
    assert column_offsets(lines[2], ["run-failed", WIDE_HOST, "1", "failed"]) == header
    assert column_offsets(lines[3], ["run-starting", "node-7", "1", "running"]) == header
    status, verdict = on_terminal(["diagnose", "run-failed", "j.db", *AS_WRITTEN], tmp_path,
                                  no_color=no_color)  # fmt: skip
    assert status == 1, verdict
    assert (SGR.findall(verdict) == []) if no_color else ("\x1b[31mfailed\x1b[0m" in verdict)
    assert "\x1b" not in SGR.sub("", verdict) and "\x07" not in verdict
    assert "red 错误 text" in verdict
