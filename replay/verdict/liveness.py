"""Whether a rank's process is still alive, as only the reader's own host can tell from its pid
and the process's start time; handed to the pure diagnosis as data."""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from replay.verdict.analysis import RunAnalysis

# A process that started this long after a rank's first event cannot be that rank: its pid
# was reused. The slack covers the whole seconds of /proc/stat's boot time.
PID_START_SLACK_S = 2.0
# Host names that many machines share: a pid recorded under one says nothing about this host.
SHARED_HOST_NAMES = frozenset({"", "localhost", "localhost.localdomain"})


def dead_ranks(analysis: RunAnalysis) -> frozenset[int]:
    """Ranks that ran on this host, journaled no end, and whose process is gone: what only the
    reader's machine can tell, handed to the pure diagnosis as data."""
    return frozenset(rank for rank, alive in _looked_up(analysis).items() if alive is False)


def live_ranks(analysis: RunAnalysis) -> frozenset[int]:
    """Ranks that ran on this host, journaled no end, and whose process is seen running (the
    same process, not a later one with its pid): however long such a rank has been silent
    (a heartbeat thread starved on a loaded machine), it has not crashed."""
    return frozenset(rank for rank, alive in _looked_up(analysis).items() if alive is True)


def _looked_up(analysis: RunAnalysis) -> dict[int, bool | None]:
    """For each rank that ran on this host and journaled no end: whether its process is alive
    (None: it cannot be told)."""
    candidates = {
        rank: view
        for rank, view in analysis.views.items()
        if view.run_started is not None
        and view.first_wall is not None
        and not (view.terminal or view.shutdown is not None)
    }
    if not candidates:
        return {}  # every rank journaled its end: nothing to look up
    host = _host()
    if host in SHARED_HOST_NAMES or not Path("/proc/self/stat").exists():
        return {}
    booted = _boot_time()
    found: dict[int, bool | None] = {}
    for rank, view in candidates.items():
        started = view.run_started
        assert started is not None and view.first_wall is not None
        if started.host == host:
            found[rank] = _alive_since(started.pid, view.first_wall, booted=booted)
    return found


@functools.cache
def _host() -> str:
    return socket.gethostname()


@functools.cache
def _boot_time() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _alive_since(pid: int, first_wall: float, *, booted: float | None) -> bool | None:
    """Whether `pid` is a live process that was already running at `first_wall` (a process
    that started later only reuses the pid); None when it cannot be told."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    # Fields after the command name, which may itself hold spaces and parentheses: state is
    # field 3, start time (clock ticks after boot) field 22.
    fields = text.rpartition(")")[2].split()
    if len(fields) < 20:
        return None
    if fields[0] in ("Z", "X", "x"):
        return False
    if fields[0] in ("T", "t"):
        return None  # stopped (SIGSTOP) or traced: there, but frozen; silence may be its hang
    if booted is None:
        return None
    try:
        started = booted + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (ValueError, OSError):
        return None
    return started <= first_wall + PID_START_SLACK_S
