"""One request in flight on every rank: each rank's result and its last sign of progress, and,
when it fails, which rank failed of itself (the culprit, as the ranks' answers tell it, until
the run's verdict names it) and which failed waiting on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from lifecycle.core.errors import COLLECTIVE_KINDS, LifecycleError
from lifecycle.serve.ranks.control import ServiceUnavailable
from lifecycle.serve.ranks.messages import Result

# A rank whose collective timed out or lost its peer failed waiting on another; the other's
# own error, when it has one, comes within this long of the first failure (the agreed abort
# or its process ending is seconds faster than a collective timeout), so the server waits that
# long before it names a rank that only waited as the request's culprit.
CULPRIT_GRACE_S = 1.0


class RequestFailed(LifecycleError):
    """A rank answered a request with an error, went away, or stopped making progress: the
    culprit, its error, and the ranks that failed waiting on it."""

    def __init__(
        self,
        *,
        request_id: str,
        culprit: int,
        error: str,
        waited: dict[int, str] | None = None,
        silent: dict[int, float] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.run_id = run_id  # the run it failed in, once the server knows it
        self.culprit = culprit
        self.error = error
        self.waited = waited or {}  # rank: its error, failed waiting on the culprit
        self.silent = silent or {}  # the ranks that made no progress, and for how long
        said = [f"rank {culprit}: {error}"]
        said += [f"rank {r} failed waiting on it: {e}" for r, e in sorted(self.waited.items())]
        super().__init__("; ".join(said))

    def answer(self, *, diagnose: str) -> dict[str, Any]:
        """The request's answer: the culprit rank and its error, the ranks that failed
        waiting on it, and the command (`diagnose`) that explains the run."""
        return {
            "detail": str(self),
            "request_id": self.request_id,
            "culprit_rank": self.culprit,
            "error": self.error,
            "waited": {str(rank): error for rank, error in sorted(self.waited.items())},
            "diagnose": diagnose,
        }

    def named(self, *, culprit: int, error: str) -> RequestFailed:
        """The same failure, its culprit and that rank's error as the run's verdict names them
        (the answers name a rank whose process went away, not why it went)."""
        return RequestFailed(
            request_id=self.request_id,
            culprit=culprit,
            error=error,
            waited={rank: e for rank, e in self.waited.items() if rank != culprit},
            silent=self.silent,
            run_id=self.run_id,
        )


class PastDeadline(LifecycleError):
    """A request's deadline passed before every rank answered it."""


class Withdrawn(LifecycleError):
    """A request was withdrawn (its client gone, its job deleted) before every rank answered."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RequestInFlight:
    """One request sent to every rank: each rank's result and its last sign of progress (and,
    while it is cancelled, where each can stop), matched to the request by id."""

    def __init__(self, *, request_id: str, ranks: Iterable[int]) -> None:
        self.request_id = request_id
        now = self.started_at = time.monotonic()
        self._last_progress = dict.fromkeys(ranks, now)
        self._steps_made = dict.fromkeys(ranks, 0)  # denoising steps each rank reported
        self._results: dict[int, Result] = {}  # in the order they came
        self._points: dict[int, int] = {}  # rank: the step after which it waits, cancelled
        self._first_failure_at: float | None = None
        self._abandoned: str | None = None
        self._withdrawn: str | None = None
        self._withdrawal_seen = False
        self._changed = threading.Condition()

    def progress(self, rank: int, step: int | None = None) -> None:
        with self._changed:
            if rank in self._last_progress:
                self._last_progress[rank] = time.monotonic()
                if step is not None:
                    self._steps_made[rank] = max(self._steps_made[rank], step + 1)

    def deliver(self, result: Result) -> None:
        with self._changed:
            self._results.setdefault(result.rank, result)
            if not result.ok and result.cancelled_after is None and self._first_failure_at is None:
                self._first_failure_at = time.monotonic()
            self._changed.notify_all()

    def cancel_point(self, rank: int, step: int) -> None:
        with self._changed:
            if rank in self._last_progress:
                self._points[rank] = step
                self._last_progress[rank] = time.monotonic()
                self._changed.notify_all()

    def fail_rank(self, rank: int, error: str) -> None:
        """The rank itself is gone (its link closed): its own failure, never a wait."""
        self.deliver(Result(request_id=self.request_id, rank=rank, ok=False, error=error))

    def abandon(self, reason: str) -> None:
        with self._changed:
            self._abandoned = reason
            self._changed.notify_all()

    def withdraw(self, reason: str) -> None:
        """Cancel the request from outside (its client gone, its job deleted): the wait in
        progress raises Withdrawn, once, and the ranks are cancelled between steps."""
        with self._changed:
            if self._withdrawn is None:
                self._withdrawn = reason
                self._changed.notify_all()

    def cancelling(self) -> None:
        """The request is being cancelled: a withdrawal from now on interrupts no wait."""
        with self._changed:
            self._withdrawal_seen = True

    @property
    def withdrawn(self) -> str | None:
        with self._changed:
            return self._withdrawn

    def stalled(self, why: str) -> RequestFailed:
        """The request given up: the ranks yet to answer are stuck in it (`why`), the one
        silent for longest its culprit."""
        now = time.monotonic()
        with self._changed:
            waiting = {r: now - t for r, t in self._last_progress.items() if r not in self._results}
        culprit = max(waiting, key=lambda r: waiting[r]) if waiting else 0
        return RequestFailed(request_id=self.request_id, culprit=culprit, error=why, silent=waiting)

    def wait(self, *, silence_s: float, until: float | None = None) -> dict[int, Result]:
        """Every rank's result (a rank's cancelled result included); raise RequestFailed once
        a rank failed of itself (or, when every failure so far is a wait on a peer,
        CULPRIT_GRACE_S after the first), at the first rank silent for `silence_s`,
        ServiceUnavailable when abandoned, Withdrawn once withdrawn, or PastDeadline at
        `until` (monotonic)."""
        if not self._wait_for(lambda waiting: not waiting, silence_s=silence_s, until=until):
            raise PastDeadline(f"request {self.request_id} past its deadline")
        with self._changed:
            return dict(self._results)

    def wait_for_points(
        self, *, silence_s: float, within_s: float, answered: int
    ) -> dict[int, int] | None:
        """Where each rank stops making steps while the request is cancelled: its CancelPoint,
        or `answered` for a rank that answered (it made every step); None when some rank did
        not say within `within_s`. Failures raise as `wait` says."""
        done = self._wait_for(
            lambda left: all(rank in self._points for rank in left),
            silence_s=silence_s,
            until=time.monotonic() + within_s,
        )
        if not done:
            return None
        with self._changed:
            return {
                r: answered if r in self._results else self._points[r] for r in self._last_progress
            }

    def _wait_for(
        self, enough: Callable[[set[int]], bool], *, silence_s: float, until: float | None
    ) -> bool:
        """Until `enough` holds of the ranks yet to answer (True) or `until` passes (False)."""
        with self._changed:
            while True:
                if self._abandoned is not None:
                    raise ServiceUnavailable(status="stopping", detail=self._abandoned)
                if self._withdrawn is not None and not self._withdrawal_seen:
                    self._withdrawal_seen = True
                    raise Withdrawn(self._withdrawn)
                now = time.monotonic()
                waiting = {r: t for r, t in self._last_progress.items() if r not in self._results}
                failed = [
                    m for m in self._results.values() if not m.ok and m.cancelled_after is None
                ]
                if failed:
                    own = [m for m in failed if m.error_kind not in COLLECTIVE_KINDS]
                    assert self._first_failure_at is not None
                    grace_ends = self._first_failure_at + CULPRIT_GRACE_S
                    if own or not waiting or now >= grace_ends:
                        raise self._failed(failed, own, waiting, now=now)
                    self._changed.wait(timeout=max(0.01, grace_ends - now))
                    continue
                if enough(set(waiting)):
                    return True
                if until is not None and now >= until:
                    return False
                silent = {r: now - t for r, t in waiting.items() if now - t > silence_s}
                if silent:
                    culprit = max(silent, key=lambda r: silent[r])
                    raise RequestFailed(
                        request_id=self.request_id,
                        culprit=culprit,
                        error=f"no progress for {silent[culprit]:.0f} s",
                        silent=silent,
                    )
                wake = min(waiting.values()) + silence_s
                self._changed.wait(timeout=max(0.05, min(wake, until or wake) - now))

    def _failed(
        self, failed: list[Result], own: list[Result], waiting: dict[int, float], *, now: float
    ) -> RequestFailed:
        """The culprit: the first rank that failed of itself; else, every failure being a
        wait on a peer, the rank yet to answer that made no progress for longest; else the
        first that failed."""
        waited = {m.rank: str(m.error) for m in failed if m.error_kind in COLLECTIVE_KINDS}
        if own:
            culprit, error = own[0].rank, str(own[0].error)
        elif waiting:
            culprit = min(waiting, key=lambda r: waiting[r])
            error = f"no progress for {now - waiting[culprit]:.0f} s while its peers waited on it"
        else:
            culprit, error = failed[0].rank, str(failed[0].error)
        waited.pop(culprit, None)
        return RequestFailed(
            request_id=self.request_id, culprit=culprit, error=error, waited=waited
        )
