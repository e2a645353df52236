"""The requests of `lifecycle serve`, one at a time: the one running on the ranks, those waiting
behind it (a bounded line: more are refused at once), and a request withdrawn (its client gone,
its job deleted) while it runs or waits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from lifecycle.serve.ranks.cancel import RequestWithdrawn
from lifecycle.serve.ranks.control import RankLink, ServiceUnavailable
from lifecycle.serve.ranks.inflight import RequestInFlight

# Requests that may wait behind the running one; more are refused with 503 at once, so that
# waiting requests cannot take every worker thread.
MAX_QUEUED_REQUESTS = 8
RETRY_AFTER_S = 5


class RequestLine:
    """The request running, those waiting, and what wakes them."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._in_line = 0
        self._running: RequestInFlight | None = None
        self._waiting: dict[str, int] = {}  # request ids running or waiting: how many of each
        self._withdrawn: dict[str, str] = {}  # requests withdrawn while waiting in line: why

    def depth(self) -> int:
        """The requests running or waiting for the ranks."""
        with self._changed:
            return self._in_line

    @contextlib.contextmanager
    def place(self) -> Iterator[None]:
        """Hold a place among the requests running or waiting; refuse at once when the line
        is full."""
        with self._changed:
            if self._in_line > MAX_QUEUED_REQUESTS:
                raise ServiceUnavailable(
                    status="busy",
                    detail=f"busy: {self._in_line} requests running or waiting",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._in_line += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_line -= 1

    @contextlib.contextmanager
    def named(self, request_id: str) -> Iterator[None]:
        """While a request of this id is running or waiting (it may be withdrawn by id)."""
        with self._changed:
            self._waiting[request_id] = self._waiting.get(request_id, 0) + 1
        try:
            yield
        finally:
            with self._changed:
                self._waiting[request_id] -= 1
                if not self._waiting[request_id]:
                    del self._waiting[request_id]
                    self._withdrawn.pop(request_id, None)

    def turn(
        self,
        request_id: str,
        *,
        steps: int,
        held: Callable[[], bool],
        refusal: Callable[[], ServiceUnavailable | None],
        links: Callable[[], dict[int, RankLink]],
    ) -> tuple[RequestInFlight, dict[int, RankLink]]:
        """Wait for the request's turn: no request running and nothing holding the line
        (`held`: the ranks being replaced); then it runs on `links`. RequestWithdrawn when it
        was withdrawn first, the `refusal` when there is one."""
        with self._changed:
            while (self._running is not None or held()) and refusal() is None:
                if request_id in self._withdrawn:
                    break
                self._changed.wait()
            why = self._withdrawn.pop(request_id, None)
            if why is not None:
                raise RequestWithdrawn(request_id=request_id, reason=why, step=None, steps=steps)
            refused = refusal()
            if refused is not None:
                raise refused
            now = links()
            running = self._running = RequestInFlight(request_id=request_id, ranks=now)
            return running, now

    def done(self) -> None:
        """The running request is over: the next may run."""
        with self._changed:
            self._running = None
            self._changed.notify_all()

    def wake(self) -> None:
        """Something changed that the waiting requests must see (a failure, a restart)."""
        with self._changed:
            self._changed.notify_all()

    def running(self) -> RequestInFlight | None:
        with self._changed:
            return self._running

    def withdraw(self, request_id: str, reason: str) -> None:
        """Cancel a request from outside: the one running stops between steps on every rank;
        one waiting is never run."""
        with self._changed:
            running = self._running
            if running is not None and running.request_id == request_id:
                running.withdraw(reason)
                return
            if request_id in self._waiting:
                self._withdrawn[request_id] = reason
                self._changed.notify_all()
