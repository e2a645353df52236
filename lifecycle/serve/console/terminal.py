"""The boot console: the progress printer's lines as they come and, while a state goes on, how
far it has got: a live bar on a terminal (rich), a line every few seconds elsewhere."""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import TextIO, cast

from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task, TaskID, TextColumn, TimeElapsedColumn
from rich.progress_bar import ProgressBar
from rich.text import Text

from lifecycle.core.format.events import StoredEvent
from lifecycle.serve.console.progress import ProgressPrinter
from lifecycle.serve.console.rankstatus import RankStatus, doing_text, expected_text, step_line
from lifecycle.serve.console.steps import StepMark
from lifecycle.serve.logs import json_lines, say

# Off a terminal, a state that goes on gets a line at most this often, and only once it has
# gone on this long: a log read later wants a sign of life, not a line per step.
PLAIN_EVERY_S = 5.0
# A live bar per rank up to this many ranks; beyond, rank 0's alone (the table's rank).
MAX_BARS = 8
FORWARD_JOIN_S = 2.0


class PlainConsole:
    """Lines to `out` (stdout) as they come; a state that goes on (rank 0's, the table's) gets
    `step_line` at most every PLAIN_EVERY_S, once its steps (or the decode after them) have
    moved since the last one, and at once as a long action that RUNNING_TEXT names starts."""

    def __init__(self, printer: ProgressPrinter, *, out: TextIO | None = None) -> None:
        self.printer = printer
        self._out = out
        self._marks: dict[int, StepMark] = {}
        # The state last said, when, at which mark, and the action then running.
        self._said: tuple[str, float, StepMark | None, str | None] | None = None
        # One rank booted here feeds its events from its main thread and its heartbeats from
        # another: one of them at a time.
        self._lock = threading.RLock()

    def show(self, lines: Iterable[str]) -> None:
        for line in lines:
            say(line, event="console", out=self._out)

    def feed(self, stored: StoredEvent) -> None:
        with self._lock:
            self.show(self.printer.feed(stored))
            if stored.rank == 0:
                # Each of rank 0's events (a heartbeat a second), on its clock, is a time to
                # say how far its state got: a decode or a compile reports no step for as
                # long as it runs.
                self.steps({}, now=stored.wall_time)

    def steps(self, marks: dict[int, StepMark], *, now: float | None = None) -> None:
        """Take the ranks' latest step marks; say how far rank 0's state got, when it is time."""
        with self._lock:
            self._marks.update(marks)
            now = time.time() if now is None else now
            status = self.printer.status(0, self._marks.get(0))
            if status is None:
                return
            state, since, mark, action = self._said or ("", 0.0, None, None)
            if state != status.state:
                since, mark, action = status.entered_at, None, None
            started = status.running is not None and status.action != action
            moved = status.mark is not None and status.mark != mark
            if started or (moved and now - since >= PLAIN_EVERY_S):
                self.show([step_line(status, now=now)])
                since, mark = now, status.mark
            self._said = (status.state, since, mark, status.action)

    def rank_stderr(self, rank: int) -> int | None:
        """Rank processes write their logs to the launcher's stderr, as they always have."""
        return None

    def log_stream(self) -> TextIO | None:
        return None

    def close(self) -> None:
        pass


class _StateBar(ProgressColumn):
    """rich's bar, pulsing while nothing says how far the state has got."""

    def render(self, task: Task) -> ProgressBar:
        known = bool(task.fields.get("known"))
        return ProgressBar(
            total=task.total if known else None,
            completed=task.completed,
            width=40,
            pulse=not known,
            animation_time=task.get_time(),
        )


class _AboveTheBar(io.TextIOBase):
    """A stream for this process's own log lines (one rank booted here): each printed above
    the bar. A terminal, as the stream it stands for is, so that the logs keep their console
    format."""

    def __init__(self, console: LiveConsole) -> None:
        self._console = console
        self._pending = ""

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            self._console.print_log(line)
        return len(text)

    def isatty(self) -> bool:
        return True


class LiveConsole:
    """The same lines, printed above a live bar per rank (its state, its request's steps, the
    time in the state and what history expects of it) that rich redraws in place. The rank
    processes' logs, which would break the bar if written to the terminal beside it, reach it
    through a terminal (a pty) of their own and are printed above it too."""

    def __init__(self, printer: ProgressPrinter, *, ranks: int) -> None:
        self.printer = printer
        self._logs_here = _stderr_is_stdout()
        self._console = Console(file=sys.stdout, highlight=False)
        self._progress: Progress = Progress(
            TextColumn("{task.description}"),
            _StateBar(),
            TextColumn("{task.fields[steps]}"),
            TimeElapsedColumn(),
            TextColumn("{task.fields[expected]}"),
            console=self._console,
            transient=True,
            # Redrawn only here, under the lock every write takes: an automatic refresh from
            # rich's own thread, racing a line printed above the bars as a bar is added, can
            # leave a stale bar in the terminal's scrollback.
            auto_refresh=False,
            redirect_stdout=True,
            redirect_stderr=self._logs_here,
        )
        self._marks: dict[int, StepMark] = {}
        self._tasks: dict[int, tuple[TaskID, str]] = {}  # rank: (its bar, the state shown)
        self._lock = threading.RLock()  # every write to the terminal, and every redraw
        self._shown = range(ranks if ranks <= MAX_BARS else 1)
        self._forwarders: list[threading.Thread] = []
        self._closed = False
        self._progress.start()

    def show(self, lines: Iterable[str]) -> None:
        with self._lock:
            for line in lines:
                self._console.print(Text(line), soft_wrap=True)

    def print_log(self, line: str) -> None:
        with self._lock:
            self._console.print(Text.from_ansi(line), soft_wrap=True)

    def feed(self, stored: StoredEvent) -> None:
        self.show(self.printer.feed(stored))
        self.steps({})

    def steps(self, marks: dict[int, StepMark], *, now: float | None = None) -> None:
        """Take the ranks' latest step marks and redraw each rank's bar."""
        # One rank booted here reports its steps from its main thread and its heartbeats
        # from another: one bar each, drawn by one at a time.
        with self._lock:
            if self._closed:  # a late step (a rank's pipe, a heartbeat) draws no bar again
                return
            self._marks.update(marks)
            for rank in self._shown:
                status = self.printer.status(rank, self._marks.get(rank))
                if status is not None:
                    self._update(status, time.time() if now is None else now)
            self._progress.refresh()

    def _update(self, status: RankStatus, now: float) -> None:
        """A rank's bar: its request's steps while it makes them, else its time in the state
        against the state's median, else a bar that only says it is busy; beside it, what the
        state is doing (a compile, a step, the decode after the steps)."""
        who = f"rank {status.rank}  " if len(self._shown) > 1 else ""
        mark, expected = status.mark, status.expected
        total, done = 1.0, 0.0
        if mark is not None and status.stepping:
            total, done = float(max(1, mark.steps)), float(mark.done)
        elif expected is not None and expected.median_s > 0:
            total = expected.median_s
            done = min(status.in_state_s(now), total * 0.99)
        shown = self._tasks.get(status.rank)
        if shown is None:
            task = self._progress.add_task("", total=total, steps="", expected="", known=False)
        else:
            task = shown[0]
            if shown[1] != status.state:  # a new state: its time starts again
                self._progress.reset(task, total=total)
        self._progress.update(
            task,
            total=total,
            completed=done,
            description=f"{who}{status.state:<13}",
            steps=doing_text(status),
            expected=expected_text(expected),
            known=status.stepping or expected is not None,
        )
        self._tasks[status.rank] = (task, status.state)

    def rank_stderr(self, rank: int) -> int | None:
        """A terminal for a rank process's stderr, whose lines are printed above the bar; None
        when stderr is not this terminal (the rank writes where it always would)."""
        if not self._logs_here:
            return None
        import pty
        import termios

        ours, theirs = pty.openpty()
        attrs = termios.tcgetattr(theirs)
        attrs[1] &= ~termios.OPOST  # lines as the rank wrote them, "\n" not "\r\n"
        termios.tcsetattr(theirs, termios.TCSANOW, attrs)
        thread = threading.Thread(
            target=self._forward, args=(ours,), name=f"rank-{rank}-stderr", daemon=True
        )
        thread.start()
        self._forwarders.append(thread)
        return theirs

    def _forward(self, fd: int) -> None:
        pending = b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the rank's end of the terminal closed with the rank
                chunk = b""
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                self.print_log(line.decode(errors="replace"))
        if pending:
            self.print_log(pending.decode(errors="replace"))
        os.close(fd)

    def log_stream(self) -> TextIO | None:
        """Where this process's own logs go while the bar is up: above it."""
        return cast(TextIO, _AboveTheBar(self)) if self._logs_here else None

    def close(self) -> None:
        """Print what the ranks' logs still hold, then take the bar away (the lines stay)."""
        for thread in self._forwarders:
            thread.join(timeout=FORWARD_JOIN_S)
        with self._lock:
            self._closed = True
            self._progress.stop()


def _stderr_is_stdout() -> bool:
    """Whether stderr is the terminal stdout is (the usual interactive start)."""
    try:
        return os.isatty(2) and os.path.samestat(os.fstat(1), os.fstat(2))
    except OSError:
        return False


def boot_console(printer: ProgressPrinter, *, ranks: int) -> PlainConsole | LiveConsole:
    """A live bar when stdout is a terminal that can draw one, else plain lines (JSON ones
    with --json-logs, on a terminal too)."""
    if sys.stdout.isatty() and os.environ.get("TERM") != "dumb" and not json_lines():
        return LiveConsole(printer, ranks=ranks)
    return PlainConsole(printer)
