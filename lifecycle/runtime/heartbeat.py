"""The heartbeat thread: a rank's state and pending collective at a fixed interval, and stalls."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

from lifecycle.core.errors import JournalError, JournalWriteFailed
from lifecycle.core.events import Heartbeat, Stalled
from lifecycle.core.machine import LifecycleMachine
from lifecycle.core.records import GroupMark, PendingCollective, ThreadStack
from lifecycle.core.states import State
from lifecycle.runtime.recorder import Recorder

MAX_STACK_CHARS = 8000


def thread_stacks() -> tuple[ThreadStack, ...]:
    """Every Python thread's current stack, innermost frame last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame))[-MAX_STACK_CHARS:]
        stacks.append(ThreadStack(name=names.get(ident, "?"), ident=ident, stack=text))
    return tuple(sorted(stacks, key=lambda s: s.name))


# A startup is over once the rank is in one of these; the startup timeout no longer applies.
STARTUP_OVER = frozenset({State.READY, State.STOPPED, State.FAILED})


def _ignore_timeout(_waited_s: float) -> None:
    pass


def _ignore_lost_journal(_exc: JournalWriteFailed) -> None:
    pass


def _no_groups() -> tuple[GroupMark, ...]:
    return ()


class HeartbeatThread:
    """Writes a heartbeat every `interval_s`, with the pending collective and every group's
    progress; one `stalled` event per state that outlives `deadline_s` on the way to ready,
    and after ready (where the state lasts as long as the server) one per collective pending
    past `collective_stall_s`.

    It is the rank's watchdog too, since the main thread may be blocked for good: it calls
    `on_startup_timeout` once when the rank is not ready `startup_timeout_s` after it started,
    and `on_journal_lost` when the journal cannot be written (then it stops beating).
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        machine: LifecycleMachine,
        interval_s: float,
        deadline_s: float,
        pending: Callable[[], PendingCollective | None],
        groups: Callable[[], tuple[GroupMark, ...]] = _no_groups,
        collective_stall_s: float | None = None,
        startup_timeout_s: float | None = None,
        on_startup_timeout: Callable[[float], None] = _ignore_timeout,
        on_journal_lost: Callable[[JournalWriteFailed], None] = _ignore_lost_journal,
    ) -> None:
        self._recorder = recorder
        self._machine = machine
        self._interval = interval_s
        self._deadline = deadline_s
        self._pending = pending
        self._groups = groups
        self._collective_stall = collective_stall_s
        self._stalled_collective: tuple[str, int] | None = None
        self._startup_timeout = startup_timeout_s
        self._on_startup_timeout = on_startup_timeout
        self._on_journal_lost = on_journal_lost
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._stalled_entry: int | None = None
        self._timed_out = False
        self._thread = threading.Thread(target=self._run, name="lifecycle-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self._interval))

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.beat()
            except JournalWriteFailed as exc:
                self._on_journal_lost(exc)
                return
            except JournalError:
                # Not a failed write (a writer already closed at shutdown): skipped, the next
                # beat tries again.
                pass
            self._check_startup_timeout()

    def _check_startup_timeout(self) -> None:
        if self._startup_timeout is None or self._timed_out:
            return
        waited_s = time.monotonic() - self._started
        if waited_s > self._startup_timeout and self._machine.state not in STARTUP_OVER:
            self._timed_out = True
            self._on_startup_timeout(waited_s)

    def beat(self) -> None:
        recorder, machine = self._recorder, self._machine
        entered = machine.entered_mono_ns
        in_state_s = machine.in_state_s()
        pending = self._pending()
        recorder.record(
            Heartbeat(
                uptime_s=time.monotonic() - self._started,
                in_state_s=in_state_s,
                pending=pending,
                groups=self._groups(),
            )
        )
        if machine.state is State.READY:
            self._check_collective_stall(pending, in_state_s)
        elif (
            machine.state not in STARTUP_OVER
            and in_state_s > self._deadline
            and self._stalled_entry != entered
        ):
            self._stalled_entry = entered
            self._stall(in_state_s, self._deadline, pending)

    def _check_collective_stall(self, pending: PendingCollective | None, in_state_s: float) -> None:
        limit = self._collective_stall
        if pending is None or limit is None or pending.waiting_s <= limit:
            return
        key = (pending.group, pending.group_seq)
        if key != self._stalled_collective:
            self._stalled_collective = key
            self._stall(in_state_s, limit, pending)

    def _stall(
        self, in_state_s: float, deadline_s: float, pending: PendingCollective | None
    ) -> None:
        # Recording a stall writes the collective ring after ready (see the recorder).
        self._recorder.record(
            Stalled(
                in_state_s=in_state_s,
                deadline_s=deadline_s,
                pending=pending,
                threads=thread_stacks(),
            )
        )
