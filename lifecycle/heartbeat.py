"""The heartbeat thread: a rank's state and pending collective at a fixed interval, and stalls."""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

from lifecycle.errors import JournalError
from lifecycle.events import Heartbeat, PendingCollective, Stalled, ThreadStack
from lifecycle.recorder import Recorder

MAX_STACK_CHARS = 8000


def thread_stacks() -> tuple[ThreadStack, ...]:
    """Every Python thread's current stack, innermost frame last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        text = "".join(traceback.format_stack(frame))[-MAX_STACK_CHARS:]
        stacks.append(ThreadStack(name=names.get(ident, "?"), ident=ident, stack=text))
    return tuple(sorted(stacks, key=lambda s: s.name))


class HeartbeatThread:
    """Writes a heartbeat every `interval_s`; one `stalled` event per state that outlives
    `deadline_s`. It also flushes the recorder's ring of collective records."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        interval_s: float,
        deadline_s: float,
        pending: Callable[[], PendingCollective | None],
    ) -> None:
        self._recorder = recorder
        self._interval = interval_s
        self._deadline = deadline_s
        self._pending = pending
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._stalled_entry: int | None = None
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
            except JournalError:
                # The journal is gone or locked for longer than the busy timeout; a heartbeat
                # that cannot be written is skipped, the next one tries again.
                continue

    def beat(self) -> None:
        recorder = self._recorder
        entered = recorder.state_entered_mono_ns
        in_state_s = (recorder.clock.mono_ns() - entered) / 1e9
        pending = self._pending()
        recorder.flush()
        recorder.record(
            Heartbeat(
                uptime_s=time.monotonic() - self._started,
                in_state_s=in_state_s,
                pending=pending,
            )
        )
        if in_state_s > self._deadline and self._stalled_entry != entered:
            self._stalled_entry = entered
            recorder.record(
                Stalled(
                    in_state_s=in_state_s,
                    deadline_s=self._deadline,
                    pending=pending,
                    threads=thread_stacks(),
                )
            )
