"""Whether a server is awake, asleep, or on its way to either (POST /sleep, /wake), and the
conflict a sleep or wake out of turn is."""

from __future__ import annotations

import threading

from lifecycle.core.errors import LifecycleError

AWAKE = "awake"
SLEEPING = "sleeping"
ASLEEP = "asleep"
WAKING = "waking"


class Conflict(LifecycleError):
    """A sleep or wake the server's state does not allow (HTTP 409); `state` names it."""

    def __init__(self, *, state: str, detail: str) -> None:
        super().__init__(detail)
        self.state = state
        self.detail = detail


class Resting:
    """Whether the server is awake, asleep, or on its way to either."""

    def __init__(self) -> None:
        self.state = AWAKE
        self._lock = threading.Lock()

    def begin(self, *, wake: bool, serving: str) -> None:
        """Enter sleeping (from awake, the server ready) or waking (from asleep); Conflict
        otherwise. `serving` is the server's health status while awake."""
        with self._lock:
            if wake and self.state != ASLEEP:
                state = serving if self.state == AWAKE else self.state
                raise Conflict(state=state, detail=f"the server is not asleep: it is {state}")
            if not wake:
                if self.state != AWAKE:
                    raise Conflict(state=self.state, detail=f"the server is {self.state} already")
                if serving != "ready":
                    raise Conflict(
                        state=serving, detail=f"only a ready server sleeps: it is {serving}"
                    )
            self.state = WAKING if wake else SLEEPING

    def end(self, state: str) -> None:
        with self._lock:
            self.state = state
