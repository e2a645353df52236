"""The boot console while a startup runs: on a terminal (a real pty) a live bar per rank with
its request's steps, the table and the ranks' logs above it; elsewhere a line every few
seconds of a state that goes on."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from lifecycle.core.format.events import (
    Error,
    Event,
    Expectations,
    RunStarted,
    StoredEvent,
    Transition,
)
from lifecycle.core.format.records import StateExpectation
from lifecycle.serve.console.progress import ProgressPrinter
from lifecycle.serve.console.steps import DECODE, StepMark, StepPipes, pipe_report
from lifecycle.serve.console.terminal import PLAIN_EVERY_S, PlainConsole
from tests.conftest import run_cli

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

MICRO = ("--model", "micro-video", "--db", "j.db")
BAR = "━"
_CONTROL = re.compile(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)")


def on_a_terminal(args: list[str], *, cwd: Path, timeout: float = 240.0) -> tuple[int, str]:
    """`python -m lifecycle ARGS` with a pty (160 columns) as its terminal: its exit status and
    everything it wrote there."""
    ours, theirs = pty.openpty()
    fcntl.ioctl(theirs, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", *args],
        cwd=cwd, stdin=theirs, stdout=theirs, stderr=theirs, start_new_session=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore", "TERM": "xterm-256color"},
    )  # fmt: skip
    os.close(theirs)
    written = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([ours], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(ours, 65536)
            except OSError:  # EIO: every holder of the terminal has gone
                break
            if not chunk:
                break
            written += chunk
        status = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=30)
        os.close(ours)
    return status, written.decode(errors="replace")


def screen(written: str) -> list[str]:
    """What the terminal shows at the end: carriage returns, line feeds, cursor-up and
    erase-line applied (the sequences rich's live display uses), colours dropped."""
    lines, row, col = [""], 0, 0
    for token in _CONTROL.split(written):
        if token == "\n":
            row, col = row + 1, 0
            lines.extend("" for _ in range(row + 1 - len(lines)))
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            if token.endswith("A"):
                row = max(0, row - int(token[2:-1] or 1))
            elif token.endswith("K"):
                lines[row] = lines[row][:col] if token[2:-1] in ("", "0") else ""
        elif token:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    return [line.rstrip() for line in lines if line.strip()]


def test_a_terminal_shows_a_live_bar_with_each_requests_steps(tmp_path: Path) -> None:
    """One rank on a terminal: a bar drawn through each warmup request's steps and then its
    decode; the table's lines above it, in order; at the end the bar is gone and the table
    stays. No --log-level: on a terminal the info lines stay out of the table's way (warning
    and above only)."""
    status, written = on_a_terminal(["boot", *MICRO], cwd=tmp_path)
    assert status == 0, written[-3000:]
    assert BAR in written
    assert re.search(r"bounded-warm .*step [1-4]/4", written), written[-3000:]
    assert re.search(r"probe .*step [1-4]/4", written)
    # After its last step, a request's bar says it decodes, not that it is at step 4/4.
    assert re.search(r"probe .*decode after step 4/4", written), written[-3000:]
    shown = screen(written)
    assert not any(BAR in line for line in shown), shown
    table = [line.split()[0] for line in shown if line.startswith("  ")]
    assert table == [
        "launch", "created", "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers",
        "ready", "accounted",
    ]  # fmt: skip
    assert "startup to ready" in shown[-2]
    assert re.fullmatch(
        r"  accounted +[0-9.]+ s from the launch to ready, unattributed [0-9.]+ s \([0-9.]+ %\)",
        shown[-1],
    )
    assert not any("[info" in line for line in shown), shown


# Slow tier: the terminal's live bars with several ranks are the default run's
# (test_a_terminal_shows_a_live_bar_with_each_requests_steps).
@pytest.mark.slow
def test_a_terminal_keeps_the_ranks_logs_above_the_bars(tmp_path: Path) -> None:
    """Two ranks on a terminal: a bar per rank, and each rank's log lines, in their console
    format, printed above the bars with the table rather than through them."""
    args = ["boot", *MICRO, "--num-ranks", "2", "--log-level", "info"]
    status, written = on_a_terminal(args, cwd=tmp_path)
    assert status == 0, written[-3000:]
    assert re.search(r"rank 0  \S+ ", written) and re.search(r"rank 1  \S+ ", written)
    shown = screen(written)
    assert not any(BAR in line for line in shown), shown[-20:]
    for rank in (0, 1):
        assert any(
            "[info     ] run_started" in line and f"rank={rank}" in line for line in shown
        ), shown[:20]
    table = [line for line in shown if line.startswith("  ")]
    assert table[0].startswith("  launch") and "startup to ready" in table[-2]
    assert table[-1].startswith("  accounted") and "the least accounted" in table[-1]
    assert shown[-1] == "boot: exit 0: every rank got to ready"


def _event(rank: int, wall: float, state: str, event: Event) -> StoredEvent:
    return StoredEvent(
        run_id="r", rank=rank, seq=0, wall_time=wall, mono_ns=0, state=state, event=event
    )


def test_off_a_terminal_a_state_that_goes_on_gets_a_line_every_few_seconds() -> None:
    """Off a terminal, rank 0's state gets no step line in its first few seconds, then one
    with its request's step and what history expects of it, and no other until a few more
    seconds have passed, however many steps are made."""
    out = io.StringIO()
    console = PlainConsole(ProgressPrinter(run_created_at=100.0), out=out)
    console.feed(
        _event(0, 101.0, "created", RunStarted(
            world_size=1, host="h", pid=1, lifecycle_version="0", torch_version="0",
            python_version="3", device="cpu", dist_backend=None,
            launcher_started_wall=100.0, process_started_wall=100.0, imports_s=1.0,
        ))
    )  # fmt: skip
    expected = StateExpectation(state="probe", median_s=19.0, p95_s=23.4, count=6, deadline_s=70)
    console.feed(_event(0, 101.5, "gate-check", Expectations(key="k", runs=6, states=(expected,))))
    console.feed(_event(0, 102.0, "probe", Transition(trigger="t", source="x", dest="probe")))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("  launch ") and "1.000 s" in lines[0]
    for step, now in ((1, 103.0), (2, 105.0)):
        console.steps({0: StepMark(state="probe", done=step, steps=50)}, now=now)
    assert len(out.getvalue().splitlines()) == len(lines)  # the state's first seconds
    console.steps({0: StepMark(state="probe", done=3, steps=50)}, now=102.0 + PLAIN_EVERY_S)
    said = out.getvalue().splitlines()[len(lines) :]
    assert said == [
        "  probe              5.0 s so far, step 3/50 of its request (expected 19.0 s, p95 23.4 s)"
    ]
    for step in range(4, 20):
        console.steps({0: StepMark(state="probe", done=step, steps=50)}, now=108.0)
    assert len(out.getvalue().splitlines()) == len(lines) + 1
    console.steps({0: StepMark(state="probe", done=20, steps=50)}, now=108.0 + PLAIN_EVERY_S)
    assert out.getvalue().splitlines()[-1].startswith("  probe             11.0 s so far, step 20")


def _fatal(rank: int) -> StoredEvent:
    return _event(rank, 103.0, "probe", Error(
        error_type="RuntimeError", error_kind="unknown", message="boom", traceback="",
        trigger=None, fatal=True,
    ))  # fmt: skip


def test_with_several_ranks_rank_0s_lines_name_it_like_the_others() -> None:
    """A rank's own lines (its fault, its error, its failure) name the rank whenever the run
    has several, rank 0 as much as rank 1; a one-rank run names none."""
    several = ProgressPrinter(run_created_at=100.0, ranks=2)
    assert several.feed(_fatal(0)) == ["[rank 0]   error in probe: RuntimeError: boom"]
    assert several.feed(_fatal(1)) == ["[rank 1]   error in probe: RuntimeError: boom"]
    alone = ProgressPrinter(run_created_at=100.0, ranks=1)
    assert alone.feed(_fatal(0)) == ["  error in probe: RuntimeError: boom"]


# A decode slower than PLAIN_EVERY_S, so that a line off a terminal comes while it runs.
SLOW_DECODE_S = PLAIN_EVERY_S + 3.0
SLOW_DECODE = f"""
import dataclasses
import time

from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline

SPEC = dataclasses.replace(
    MODEL_PRESETS["micro-video"], name="slow-decode-video", declares_residency=False
)


class SlowDecode(TinyVideoPipeline):
    def decode(self, latents, shape):
        time.sleep({SLOW_DECODE_S})
        return super().decode(latents, shape)


PLUGIN = (SPEC, lambda spec, comm: SlowDecode(spec, comm=comm))
"""


def test_off_a_terminal_a_long_decode_after_the_last_step_is_said(tmp_path: Path) -> None:
    """Off a terminal, a request whose decode goes on after its last denoising step gets a
    line that says it decodes, within a few seconds, rather than none until its state ends."""
    (tmp_path / "slow_decode_plugin.py").write_text(SLOW_DECODE)
    done = run_cli(
        "lifecycle", ["boot", "--pipeline", "slow_decode_plugin:PLUGIN", "--db", "j.db"],
        cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    said = [line for line in lines if "so far" in line]
    assert any(
        re.fullmatch(r"  bounded-warm +\d+\.\d s so far, decode after step 2/2 of its request",
                     line)
        for line in said
    ), lines  # fmt: skip
    row = next(i for i, line in enumerate(lines) if re.match(r"  bounded-warm +[\d.]+ s  ", line))
    assert any("decode" in line for line in lines[:row])


def test_off_a_terminal_a_compile_is_said_as_it_starts(tmp_path: Path) -> None:
    """Off a terminal, --compile's compile gets a line of its own as it starts, before the
    gate-check row that says what it compiled, rather than no line for as long as it runs."""
    done = run_cli("lifecycle", ["boot", *MICRO, "--compile"], cwd=tmp_path, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if re.match(r"  gate-check +[\d.]+ s  ", line))
    assert "compiled 4 blocks" in lines[row]
    assert any(
        re.fullmatch(r"  gate-check +\d+\.\d s so far, compiling the denoiser's repeated blocks",
                     line)
        for line in lines[:row]
    ), lines  # fmt: skip


def test_a_ranks_step_and_its_decode_cross_the_pipe_to_its_launcher() -> None:
    """A rank's report through a real pipe: its steps, then the decode after them, each read
    by the launcher as the rank's latest mark, stamped with the rank's state."""
    pipes = StepPipes(1)
    try:
        report = pipe_report(pipes.env_for(0), lambda: "probe")
        assert report is not None
        report(3, 4, None)
        assert pipes.read() == {0: StepMark(state="probe", done=3, steps=4)}
        report(4, 4, None)
        report(4, 4, DECODE)
        assert pipes.read() == {0: StepMark(state="probe", done=4, steps=4, stage=DECODE)}
    finally:
        pipes.close()
