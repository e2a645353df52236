"""The server's failure: the first sign that the ranks failed, kept at once (health turns 503),
then, once the ranks' ends settled, the run's verdict, which names the culprit `replay
diagnose` names, in the failure line and in a failed request's answer alike."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from lifecycle.core.format.view import RankView
from lifecycle.serve.ranks.inflight import RequestFailed
from lifecycle.verdict.diagnose import Diagnosis
from lifecycle.verdict.headline import named_culprits
from lifecycle.verdict.launched import (
    LaunchedRun,
    culprit_error,
    failure_reason,
    launched_verdict,
)

# Once the ranks failed, the failure line and a failed request's answer wait this long at most
# for every rank to journal how it ended (the agreed abort takes a few store polls, a rank's
# exit a moment more), so that they name the culprit the run's verdict names: the first rank
# to fail is often a victim, its collective timed out waiting on the rank that hung.
VERDICT_WAIT_S = 2.0
# How much longer than that a request's answer waits for the verdict to be made (a poll).
VERDICT_SLACK_S = 1.0


class RunFailure:
    """Why the ranks failed for good: the first reason seen, until the run's verdict replaces
    it with the culprit, how and where it went wrong, and what the other ranks did after."""

    def __init__(self, run: LaunchedRun) -> None:
        self.run = run
        self.reason: str | None = None  # sticky: once set, /health stays 503
        self.at: float | None = None  # monotonic time of the first failure
        self.verdict: Diagnosis[LaunchedRun] | None = None
        self._codes: list[int | None] = []  # each rank's exit status when it was made
        self._judged = threading.Event()
        self._lock = threading.Lock()

    def seen(self, reason: str) -> bool:
        """Keep `reason` unless one was seen before; whether it was the first."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason, self.at = reason, time.monotonic()
            return True

    @property
    def judged(self) -> bool:
        return self._judged.is_set()

    def settled(self, codes: list[int | None], lost: Mapping[int, str]) -> bool:
        """The ranks failed, the verdict is still to be made, and every rank's process has
        ended (or was lost), so that the journal holds how each ended; or the ranks had
        VERDICT_WAIT_S to journal it since the first failure."""
        if self.reason is None or self.judged:
            return False
        if all(code is not None or rank in lost for rank, code in enumerate(codes)):
            return True
        return self.at is not None and time.monotonic() - self.at >= VERDICT_WAIT_S

    def judge(
        self, views: Mapping[int, RankView], codes: list[int | None], lost: Mapping[int, str]
    ) -> str | None:
        """Make the run's verdict; the reason becomes its culprit first and what the other
        ranks did after (a failure the journal does not show, such as a control link that
        closed, keeps the words it was seen with). The reason, to say."""
        verdict = launched_verdict(self.run, views, codes, now=time.time(), lost=frozenset(lost))
        reason = failure_reason(verdict, views, codes) if verdict.culprit_ranks else None
        with self._lock:
            self.verdict, self._codes = verdict, list(codes)
            if reason is not None:
                self.reason = reason
            told = self.reason
        self._judged.set()
        return told

    def named(self, failed: RequestFailed) -> RequestFailed:
        """A failed request, once the verdict is made (within VERDICT_WAIT_S and a poll),
        named as the verdict names its culprit and what went wrong with it: its own error, or
        where it hung while its peers waited on it. As the ranks answered where the verdict
        names none."""
        self._judged.wait(timeout=VERDICT_WAIT_S + VERDICT_SLACK_S)
        with self._lock:
            verdict, codes = self.verdict, self._codes
        named = named_culprits(verdict) if verdict is not None else ()
        if not named:
            return failed
        return failed.named(culprit=named[0].rank, error=culprit_error(named[0], codes))
