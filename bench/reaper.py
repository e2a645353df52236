"""Every process a benchmark starts ends with the benchmark run, however it ends: a timeout's
SIGTERM, Ctrl-C or a hang up included. Boots start in sessions of their own (so that a
benchmark can kill one boot's whole tree), which a signal to the run's process group never
reaches; the run instead adopts every descendant that loses its parent (Linux's child
subreaper) and kills all that are left when it stops."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 2.0  # for a boot to journal its stop before it is killed


def adopt_orphans() -> bool:
    """Make this process the reaper of its orphaned descendants, so that a grandchild whose
    parent dies (a rank of a killed boot) stays in reach; False where Linux cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def descendants(root: int | None = None) -> list[int]:
    """The live descendants of `root` (this process), children first, read from /proc."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def kill_descendants(*, grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every descendant, then SIGKILL what is left after `grace_s`; the pids found."""
    found = descendants()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 0.0)
        while time.monotonic() < deadline and descendants():
            time.sleep(0.05)
        found = sorted({*found, *descendants()})
    return found


def _stop(number: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + number)


@contextlib.contextmanager
def reaping() -> Iterator[None]:
    """Run the benchmarks; on the way out, whatever ended them, no process they started
    is left behind."""
    adopt_orphans()
    previous = {sig: signal.signal(sig, _stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        left = kill_descendants()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if left:
            print(f"bench: ended {len(left)} process(es) it had started", file=sys.stderr)
