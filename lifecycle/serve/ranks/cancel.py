"""The agreed cancel of a request past its deadline, at both ends of the control channel: the
server asks every rank where it can stop (Cancel), each answers the step after its last one
made and makes no step past it (CancelPoint), and the server tells every rank the latest of
them (CancelAt). Every rank then stops after that same step, between denoising steps, so that
none is left in a collective a peer never enters."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from lifecycle.core.decisions.requesttime import RequestCancelled, TimeBound
from lifecycle.core.errors import LifecycleError, RequestAborted
from lifecycle.serve.ranks.control import RankLink
from lifecycle.serve.ranks.inflight import PastDeadline, RequestInFlight, Withdrawn
from lifecycle.serve.ranks.messages import Cancel, CancelAt, CancelPoint, Result

# How long the server waits for every rank's CancelPoint (each rank's reader thread answers at
# once, whatever its main thread is doing): past it, a rank is frozen or gone, the cancel is
# withdrawn, and the request's other bounds (its silence, the collectives' timeout) end it.
AGREE_S = 5.0
# How long a rank waits at its CancelPoint for CancelAt before it goes on by itself: the
# server's bound, and as long again for the message to arrive.
RANK_WAIT_S = 2 * AGREE_S
_WAIT_POLL_S = 0.1  # how often a rank waiting at its point looks whether it was told to stop


class RequestPastDeadline(LifecycleError):
    """A request the server cancelled once past its deadline: every rank stopped after the same
    step (the answer is a 504)."""

    def __init__(
        self, *, request_id: str, bound: TimeBound, step: int, steps: int, after_s: float
    ) -> None:
        self.request_id = request_id
        self.bound = bound
        self.step = step  # the last step every rank made, from 0
        self.steps = steps
        self.after_s = after_s
        super().__init__(
            f"request {request_id} cancelled after step {step + 1} of {steps}, {after_s:.1f} s"
            f" in: past its deadline of {bound.rule()}"
        )

    def answer(self) -> dict[str, Any]:
        prediction = self.bound.prediction
        return {
            "detail": str(self),
            "request_id": self.request_id,
            "deadline_s": round(self.bound.seconds, 3),
            "predicted_s": None if prediction is None else round(prediction.seconds, 3),
            "request_timeout_s": self.bound.limit_s,
            "steps_done": self.step + 1,
            "steps": self.steps,
        }


class RequestWithdrawn(LifecycleError):
    """A request cancelled from outside (its client gone, its job deleted): every rank stopped
    after the same step, or it ended before it could."""

    def __init__(self, *, request_id: str, reason: str, step: int | None, steps: int) -> None:
        self.request_id = request_id
        self.reason = reason
        self.step = step  # the last step every rank made (from 0); None: none stopped early
        self.steps = steps
        done = "" if step is None else f" after step {step + 1} of {steps}"
        super().__init__(f"request {request_id} cancelled{done}: {reason}")


def deadline_reason(bound: TimeBound) -> str:
    """Why the ranks cancel, as each journals it."""
    return f"past its deadline of {bound.rule()}"


def wait_within(
    request: RequestInFlight,
    links: Mapping[int, RankLink],
    *,
    silence_s: float,
    bound: TimeBound,
    steps: int,
) -> dict[int, Result]:
    """Every rank's result, as `request.wait` gives it, within the request's time `bound`.
    Past it, or once the request is withdrawn (`request.withdraw`), the agreed cancel:
    RequestPastDeadline (or RequestWithdrawn) once every rank stopped after the same step, and
    RequestFailed, the ranks taken for stalled, when they do not stop within the bound's
    allowance for a step (a step that never ends)."""
    try:
        return request.wait(silence_s=silence_s, until=request.started_at + bound.seconds)
    except PastDeadline:
        reason = deadline_reason(bound)
    except Withdrawn as exc:
        reason = exc.reason
    request.cancelling()
    for link in links.values():
        link.send(Cancel(request_id=request.request_id, reason=reason))
    points = request.wait_for_points(silence_s=silence_s, within_s=AGREE_S, answered=steps)
    step = None if points is None else max(points.values(), default=steps)
    for link in links.values():
        link.send(CancelAt(request_id=request.request_id, step=step, reason=reason))
    stop_s = bound.stop_s(silence_s)
    try:
        results = request.wait(silence_s=silence_s, until=time.monotonic() + stop_s)
    except PastDeadline:
        raise request.stalled(f"it did not stop within {stop_s:.1f} s of its cancel") from None
    stopped = [r.cancelled_after for r in results.values() if r.cancelled_after is not None]
    withdrawn = request.withdrawn
    if withdrawn is not None:
        raise RequestWithdrawn(
            request_id=request.request_id,
            reason=withdrawn,
            step=max(stopped) if stopped else None,
            steps=steps,
        )
    if not stopped:
        return results  # every rank made its last step before it could stop
    raise RequestPastDeadline(
        request_id=request.request_id,
        bound=bound,
        step=max(stopped),
        steps=steps,
        after_s=time.monotonic() - request.started_at,
    )


class StepCancels:
    """A rank's end of the agreed cancel: its reader thread answers Cancel and CancelAt, its
    main thread calls `after_step` after each denoising step of a request it serves (where it
    waits at its CancelPoint, and raises RequestCancelled at the agreed step)."""

    def __init__(self, *, rank: int, send: Callable[[CancelPoint], None]) -> None:
        self._rank = rank
        self._send = send
        self._changed = threading.Condition()
        self._current: str | None = None  # the request the main thread is serving
        self._done = -1  # its last step made, from 0
        self._points: dict[str, int] = {}  # request: the step after which this rank waits
        self._agreed: dict[str, tuple[int | None, str]] = {}  # request: (CancelAt's step, why)
        self._ended: deque[str] = deque(maxlen=16)  # requests answered: a late cancel is moot

    def on_message(self, message: Cancel | CancelAt) -> None:
        """The reader thread: a Cancel is answered with this rank's point at once; a CancelAt
        is kept for the main thread."""
        with self._changed:
            if message.request_id in self._ended:
                return
            if isinstance(message, CancelAt):
                self._agreed[message.request_id] = (message.step, message.reason)
                self._changed.notify_all()
                return
            # A request not begun yet (its Generate still in the inbox) stops after its first.
            point = self._done + 1 if message.request_id == self._current else 0
            self._points[message.request_id] = point
        self._send(CancelPoint(request_id=message.request_id, rank=self._rank, step=point))

    def begin(self, request_id: str) -> None:
        with self._changed:
            self._current, self._done = request_id, -1
            for kept in (self._points, self._agreed):
                for other in [r for r in kept if r != request_id]:
                    del kept[other]

    def end(self, request_id: str) -> None:
        """The request is answered (before its result is sent: a cancel after it is moot)."""
        with self._changed:
            self._ended.append(request_id)
            self._current = None
            self._points.pop(request_id, None)
            self._agreed.pop(request_id, None)

    def after_step(
        self, request_id: str, step: int, *, steps: int, stopping: Callable[[], str | None]
    ) -> None:
        """After step `step` (from 0): go on, or, the request being cancelled, wait at this
        rank's point for the step every rank stops after and raise RequestCancelled there.
        `stopping` says why the rank is told to stop, if it is (RequestAborted)."""
        with self._changed:
            self._done = step
            point = self._points.get(request_id)
            if point is None or step < point:
                return
            give_up = time.monotonic() + RANK_WAIT_S
            while request_id not in self._agreed:
                why = stopping()
                if why is not None:
                    raise RequestAborted(request_id=request_id, step=step, reason=why)
                if time.monotonic() >= give_up:
                    # The server never said: go on, as it does when it withdraws the cancel.
                    self._agreed[request_id] = (None, "")
                    break
                self._changed.wait(_WAIT_POLL_S)
            at, reason = self._agreed[request_id]
        if at is not None and step >= at:
            raise RequestCancelled(request_id=request_id, step=step, steps=steps, reason=reason)
