"""Stragglers while serving (pure): each rank's lag entering a request's collectives against
its peers, and the rank consistently late over its latest requests (docs/ranks.md,
"Stragglers")."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# A rank is named late only when the median of its latest lags is at least this: below it,
# a lag is the scheduling noise of a loaded host, not a slow device or link.
STRAGGLER_MIN_S = 0.002
# ... and at least this many times the next latest rank's median.
STRAGGLER_MARGIN = 3.0
# The fewest requests a rank's median is taken over before it may be named.
STRAGGLER_MIN_REQUESTS = 3


def entry_lags(entries: Sequence[Sequence[float]]) -> list[float | None]:
    """Each member's lag in one group over one request: `entries[m][c]` is when member m
    entered the request's collective c (NaN where its ring no longer holds it); a member's
    lag is the median, over the collectives every member has, of how long after the first
    member it entered. None for a member with no such collective."""
    members = len(entries)
    count = min((len(row) for row in entries), default=0)
    lags: list[list[float]] = [[] for _ in range(members)]
    for c in range(count):
        column = [entries[m][c] for m in range(members)]
        if not all(math.isfinite(t) for t in column):
            continue
        first = min(column)
        for m, t in enumerate(column):
            lags[m].append(t - first)
    return [statistics.median(each) if each else None for each in lags]


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggler:
    """A rank consistently late: the median of its latest requests' lags, in `group`."""

    rank: int
    group: str
    median_lag_s: float
    requests: int
    next_lag_s: float  # the next latest rank's median

    def describe(self) -> str:
        return (
            f"rank {self.rank} enters {self.group}'s collectives"
            f" {self.median_lag_s * 1e3:.0f} ms after its peers, median of the last"
            f" {self.requests} requests"
        )


def straggler(lags: Mapping[int, Sequence[tuple[float, str]]]) -> Straggler | None:
    """The rank consistently late among `lags` (each rank's latest (lag seconds, group)),
    if one is: its median at least STRAGGLER_MIN_S and STRAGGLER_MARGIN times every other
    rank's, over at least STRAGGLER_MIN_REQUESTS requests."""
    medians: dict[int, float] = {
        rank: statistics.median(lag for lag, _ in each)
        for rank, each in lags.items()
        if len(each) >= STRAGGLER_MIN_REQUESTS
    }
    if len(medians) < 2:
        return None
    late = max(medians, key=lambda r: (medians[r], -r))
    others = max(m for r, m in medians.items() if r != late)
    lag = medians[late]
    if lag < STRAGGLER_MIN_S or lag < STRAGGLER_MARGIN * others:
        return None
    groups = [group for _, group in lags[late]]
    return Straggler(
        rank=late,
        group=max(set(groups), key=groups.count),
        median_lag_s=lag,
        requests=len(lags[late]),
        next_lag_s=others,
    )
