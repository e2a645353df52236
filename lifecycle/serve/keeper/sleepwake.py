"""`POST /sleep` and `POST /wake`: the server stops admitting, lets the request in flight
finish, and every rank goes from ready to asleep (its weights let go to the host's keeper);
then from asleep through waking back to ready (the weights back and verified). Each is a
journaled transition of every rank; a second sleep, or a wake of a server awake, is a conflict
naming the state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lifecycle.core.requestid import request_id_of
from lifecycle.serve.keeper.resting import ASLEEP, AWAKE
from lifecycle.serve.ranks.inflight import PastDeadline, RequestFailed
from lifecycle.serve.ranks.messages import Rest

if TYPE_CHECKING:
    from lifecycle.serve.http.service import Service


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
