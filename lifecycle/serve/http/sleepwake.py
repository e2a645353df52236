"""`POST /sleep` and `POST /wake`: the server stops admitting, lets the request in flight
finish, and every rank goes from ready to asleep (its weights let go to the host's keeper);
then from asleep through waking back to ready (the weights back and verified). Each is a
journaled transition of every rank; a second sleep, or a wake of a server awake, is a conflict
naming the state."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from lifecycle.core.errors import LifecycleError
from lifecycle.core.requestid import request_id_of
from lifecycle.serve.ranks.inflight import PastDeadline, RequestFailed
from lifecycle.serve.ranks.messages import Rest

if TYPE_CHECKING:
    from lifecycle.serve.http.service import Service

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


def rest(service: Service, *, wake: bool) -> dict[str, Any]:
    """Put the ranks to sleep or wake them, after the request in flight; what it took."""
    resting = service.resting
    resting.begin(wake=wake, serving=service.health()[1])
    service.line.wake()  # the requests waiting in line are refused now
    named = request_id_of(None)
    started = time.monotonic()
    done = ASLEEP if wake else AWAKE  # where a failure leaves it (the ranks unchanged)
    try:
        with service.line.named(named):
            running, links = service.line.turn(
                named,
                steps=0,
                held=lambda: service.restarts.pending is not None,
                refusal=service.stopping_or_failed,
                links=service.control.snapshot,
            )
            service.control.begin(running)
            try:
                for rank, link in sorted(links.items()):
                    if not link.send(Rest(request_id=named, wake=wake)):
                        running.fail_rank(rank, "control connection closed")
                limit = service.args.startup_timeout_s
                running.wait(silence_s=limit, until=time.monotonic() + limit)
            except PastDeadline:
                service.fail(f"{'wake' if wake else 'sleep'} not done within {limit:g} s")
                raise
            except RequestFailed as exc:
                raise service.request_failed(running, links, exc) from None
            finally:
                service.control.end(running)
                service.line.done()
        done = AWAKE if wake else ASLEEP
        service.catch_up()
    finally:
        resting.end(done)
        service.line.wake()
    return {"status": "ready" if wake else ASLEEP, "seconds": round(time.monotonic() - started, 3)}
