"""A `slow` fault's model of a throttled device (`--fault RANK:STATE:slow[:FACTOR]`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Slowdown:
    """A `slow` fault's model of a throttled device: once it fired, the rank stands idle
    (FACTOR - 1) times as long as each stretch of its own compute took, before it goes on to
    its next collective (or, in gate-check's probe, after each timed matmul), so that its
    peers see it FACTOR times slower. On a host whose ranks share its cores, burning the
    compute again would slow the peers too, which a slow device does not."""

    factor: float = 1.0
    accounted: float = field(default_factory=time.perf_counter)  # compute before: stretched

    def start(self, factor: float) -> None:
        self.factor = factor
        self.accounted = time.perf_counter()

    def stretch(self, since: float | None = None) -> float:
        """Stand idle for the compute since `since` (or since the last stretch) times
        FACTOR - 1; the seconds stood."""
        if self.factor <= 1.0:
            return 0.0
        start = max(self.accounted, since if since is not None else self.accounted)
        extra = (time.perf_counter() - start) * (self.factor - 1.0)
        if extra > 0:
            threading.Event().wait(extra)
        self.accounted = time.perf_counter()
        return max(0.0, extra)

    def forgive(self) -> None:
        """What ran since the last stretch is not compute the fault slows (a load from disk)."""
        self.accounted = time.perf_counter()
