"""The heartbeat thread: a rank's state and pending collective at a fixed interval, and stalls."""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from collections.abc import Callable

from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.errors import JournalError, JournalWriteFailed
from lifecycle.core.format.events import (
    ActionFinished,
    Expectations,
    Heartbeat,
    Stalled,
    StoredEvent,
)
from lifecycle.core.format.records import GroupMark, PendingCollective, ThreadStack
from lifecycle.core.format.states import SERVING_STATES, TERMINAL_STATES, State
from lifecycle.runtime.recorder import Recorder

MAX_STACK_CHARS = 8000
# A ready rank may serve idle for months. Once it serves, a heartbeat event is journaled only
# when something a reader places the rank by differs from the last one journaled (its state,
# its groups' progress, a stall since) or while it waits in a collective (each beat times the
# wait), and otherwise every SLOW_BEAT_S; the beats between only keep the rank's summary row
# current, in place, and liveness is judged from that row. Five minutes keeps an idle rank to
# a dozen rows an hour, and within the ten minutes in which `db prune` holds a run to be still
# written.
SLOW_BEAT_S = 300.0
THREAD_NAME = "lifecycle-heartbeat"
# The thread wakes this long after a state's deadline, so that the state has outlived it.
DUE_SLACK_S = 0.01


def thread_stacks() -> tuple[ThreadStack, ...]:
    """Every Python thread's current stack, innermost frame last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame))[-MAX_STACK_CHARS:]
        stacks.append(ThreadStack(name=names.get(ident, "?"), ident=ident, stack=text))
    return tuple(sorted(stacks, key=lambda s: s.name))


# A startup is over once the rank is in one of these; the startup timeout no longer applies.
STARTUP_OVER = SERVING_STATES | TERMINAL_STATES


def _ignore_timeout(_waited_s: float) -> None:
    pass


def _ignore_lost_journal(_exc: JournalWriteFailed) -> None:
    pass


def _no_groups() -> tuple[GroupMark, ...]:
    return ()


class HeartbeatThread:
    """Beats every `interval_s`: a heartbeat event with the pending collective and every
    group's progress (once the rank serves, only when SLOW_BEAT_S says so; else in place);
    one `stalled` event per state that outlives its deadline on the way to ready (the one the
    rank's `expectations` learned from history for that state, else `deadline_s`), and after
    ready (where the state lasts as long as the server) one per collective pending past
    `collective_stall_s`.

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
        # What the rank's own events say, as they are recorded (see `_observe`).
        self._deadlines: dict[str, float] = {}  # per state, from its expectations
        self._serving = False  # its ready action finished: beats may stay in place
        self._stalled_since_beat = False
        self._journaled: tuple[object, ...] | None = None  # the last heartbeat event's marks
        self._journaled_at = 0.0  # and when (monotonic)
        recorder.subscribe(self._observe)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cpu_s(self) -> float:
        """The CPU time the thread has used so far, by its own clock (0 before it starts)."""
        ident = self._thread.ident
        if ident is None or not self._thread.is_alive():
            return 0.0
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(ident))
        except OSError:  # it ended since: its clock is gone with it
            return 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self._interval))

    def _run(self) -> None:
        next_beat = time.monotonic() + self._interval
        while not self._stop.wait(max(0.0, min(next_beat, self._stall_due()) - time.monotonic())):
            if time.monotonic() < next_beat:
                # Woken at the state's deadline between two beats: a stall is journaled when
                # it is due, not up to an interval later.
                self._check_state_stall(self._pending)
                continue
            next_beat = time.monotonic() + self._interval
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

    def _observe(self, stored: StoredEvent) -> None:
        """Called with each event the rank records, in the recording thread."""
        event = stored.event
        if isinstance(event, Expectations):
            self._deadlines = {s.state: s.deadline_s for s in event.states}
        elif isinstance(event, ActionFinished) and event.ok and stored.state == State.READY:
            self._serving = True
        elif isinstance(event, Stalled):
            self._stalled_since_beat = True

    def deadline_s(self, state: State) -> float:
        """How long the rank may stay in `state` before it counts as stalled."""
        return self._deadlines.get(state.value, self._deadline)

    def beat(self) -> None:
        recorder, machine = self._recorder, self._machine
        state = machine.state
        in_state_s = machine.in_state_s()
        pending = self._pending()
        groups = self._groups()
        if self._journals(state, pending, groups):
            recorder.record(
                Heartbeat(
                    uptime_s=time.monotonic() - self._started,
                    in_state_s=in_state_s,
                    pending=pending,
                    groups=groups,
                )
            )
        else:
            recorder.beat_in_place()
        if state in SERVING_STATES:
            self._check_collective_stall(pending, in_state_s)
        else:
            self._check_state_stall(lambda: pending)

    def _stall_due(self) -> float:
        """When (monotonic) the current state outlives its deadline; inf when no stall is to
        come in it (the startup is over, or this stay in the state already stalled)."""
        machine = self._machine
        state = machine.state
        if state in STARTUP_OVER or self._stalled_entry == machine.entered_mono_ns:
            return math.inf
        return time.monotonic() + self.deadline_s(state) - machine.in_state_s() + DUE_SLACK_S

    def _check_state_stall(self, pending: Callable[[], PendingCollective | None]) -> None:
        """One `stalled` event for a stay in a startup state past its deadline."""
        machine = self._machine
        state, entered = machine.state, machine.entered_mono_ns
        in_state_s = machine.in_state_s()
        deadline = self.deadline_s(state)
        if state not in STARTUP_OVER and in_state_s > deadline and self._stalled_entry != entered:
            self._stalled_entry = entered
            self._stall(in_state_s, deadline, pending())

    def _journals(
        self, state: State, pending: PendingCollective | None, groups: tuple[GroupMark, ...]
    ) -> bool:
        """Whether this beat is journaled as an event (see SLOW_BEAT_S)."""
        marks = (state, groups)
        now = time.monotonic()
        due = (
            not self._serving
            or pending is not None
            or self._stalled_since_beat
            or marks != self._journaled
            or now - self._journaled_at >= SLOW_BEAT_S
        )
        if due:
            self._journaled, self._journaled_at = marks, now
            self._stalled_since_beat = False
        return due

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
