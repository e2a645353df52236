"""The ranks started anew after a request failed in them: a request that fails, or stalls in a
step that never ends, fails alone, and `serve` replaces its ranks with a new group (a new run of
the journal) instead of failing for good, at most `--max-restarts` times. Only the launcher
that spawned the ranks can; under torchrun, serve fails and torchrun's agent restarts the
group (its own `--max-restarts`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from lifecycle.serve.logs import say

# serve's default --max-restarts: a request that fails every group it runs in (a shape that
# always stalls, a fault) is not served for ever; a server replaced that often is failing.
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class Relaunch:
    """What replaces a group of ranks (the launcher's): `end` its processes (SIGTERM, then
    SIGKILL), `close` what followed them (the group and its control channel), and `start` a
    new group and its control channel (spawned, not yet ready)."""

    end: Callable[[Any], None]
    close: Callable[[Any, Any], None]
    start: Callable[[], tuple[Any, Any]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Restart:
    """One group of ranks replaced: the run it ended, the run that replaced it, and why."""

    ended_run: str
    new_run: str
    why: str
    at: float  # wall time the new group was started
    stopped_s: float  # how long the old group took to end


class Restarts:
    """How many restarts are left, the one under way, and those done."""

    def __init__(self, *, relaunch: Relaunch | None, allowed: int) -> None:
        self.relaunch = relaunch
        self.allowed = allowed if relaunch is not None else 0
        self.done: list[Restart] = []
        self._pending: str | None = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> str | None:
        """Why the ranks are being replaced now; None when they are not."""
        with self._lock:
            return self._pending

    def begin(self, why: str) -> bool:
        """Take a restart for `why`; False when none is left (or the ranks cannot be)."""
        with self._lock:
            if self._pending is not None or len(self.done) >= self.allowed:
                return False
            self._pending = why
            return True

    def ended(self, restart: Restart | None) -> None:
        """The restart under way is over: done (`restart`), or given up (None)."""
        with self._lock:
            if restart is not None:
                self.done.append(restart)
            self._pending = None

    def count(self) -> int:
        with self._lock:
            return len(self.done)

    def describe(self) -> dict[str, Any]:
        """What /lifecycle shows under "restarts"."""
        with self._lock:
            return {
                "allowed": self.allowed,
                "pending": self._pending,
                "done": [asdict(r) for r in self.done],
            }

    def record(self, *, ended_run: str, new_run: str, why: str, began: float) -> Restart:
        return Restart(
            ended_run=ended_run,
            new_run=new_run,
            why=why,
            at=time.time(),
            stopped_s=round(time.monotonic() - began, 3),
        )


class Replaceable(Protocol):
    """What a restart needs of the service whose ranks it replaces."""

    restarts: Restarts
    group: Any
    control: Any
    stopping: str | None

    def following_paused(self) -> contextlib.AbstractContextManager[None]: ...

    def settle(self) -> None: ...

    def swap(self, group: Any, control: Any) -> None: ...

    def wake_line(self) -> None: ...


def replace_ranks(service: Replaceable) -> None:
    """Replace the ranks a request failed in: end them (their journal says how the run
    ended), then start a new group, unless the server stops first."""
    restarts = service.restarts
    why, relaunch = restarts.pending, restarts.relaunch
    assert why is not None and relaunch is not None
    old = service.group
    began = time.monotonic()
    left = restarts.allowed - restarts.count() - 1
    say(
        f"restarting the ranks of run {old.run_id}: {why} ({left} restart(s) left after)",
        event="serve-restarting",
        run_id=old.run_id,
        why=why,
    )
    relaunch.end(old)
    with service.following_paused():
        service.settle()  # the old run's last events: its verdict is made
        relaunch.close(old, service.control)
        if service.stopping is not None:
            restarts.ended(None)
            return
        group, control = relaunch.start()
        service.swap(group, control)
        restarts.ended(restarts.record(ended_run=old.run_id, new_run=group.run_id, why=why,
                                       began=began))  # fmt: skip
    service.wake_line()
    say(
        f"restarted: run {group.run_id} replaces run {old.run_id}",
        event="serve-restarted",
        run_id=group.run_id,
        replaces=old.run_id,
    )
