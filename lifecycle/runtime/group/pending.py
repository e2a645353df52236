"""The collective a rank is waiting in, written by the rank and read by its heartbeat thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from lifecycle.core.format.records import PendingCollective


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    group: str
    group_seq: int
    op: str
    purpose: str
    since_mono: float


class PendingTracker:
    """The collective this rank is waiting in, readable from the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Pending | None = None
        # When the rank last left a collective (perf_counter): where its compute since began.
        self.left_at = time.perf_counter()

    def set(self, pending: Pending) -> None:
        with self._lock:
            self._pending = pending

    def clear(self) -> None:
        with self._lock:
            self._pending = None
        self.left_at = time.perf_counter()

    def snapshot(self) -> PendingCollective | None:
        with self._lock:
            p = self._pending
        if p is None:
            return None
        return PendingCollective(
            group=p.group,
            group_seq=p.group_seq,
            op=p.op,
            purpose=p.purpose,
            waiting_s=time.perf_counter() - p.since_mono,
        )
