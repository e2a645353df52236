"""Interleaved A/B sampling and the order statistics quoted from it (medians, p99)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Paired:
    """Samples of two sides taken alternately in one run: a[i] and b[i] ran back to back."""

    a: tuple[float, ...]
    b: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """median(a) / median(b)."""
        return median(self.a) / median(self.b)

    @property
    def paired_ratio(self) -> float:
        """The median of the paired ratios a[i] / b[i]: the ratio that goes with
        `difference`, as little moved by drift as it is."""
        return median([x / y for x, y in zip(self.a, self.b, strict=True)])

    @property
    def difference(self) -> float:
        """The median of the paired differences a[i] - b[i]: less noisy than a difference of
        medians when the machine's speed drifts during the run."""
        return median([x - y for x, y in zip(self.a, self.b, strict=True)])


def median(samples: Sequence[float]) -> float:
    if not samples:
        raise ValueError("no samples")
    return float(statistics.median(samples))


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linearly interpolated between the closest ranks."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def interleave(
    side_a: Callable[[], float],
    side_b: Callable[[], float],
    *,
    pairs: int,
    discard: int = 0,
) -> Paired:
    """Run A and B alternately, `pairs` times each, each call returning its own measure.

    The order flips every pair (A B, B A, A B, ...) so that neither side always runs first
    after the other; the first `discard` pairs warm caches up and are dropped.
    """
    a: list[float] = []
    b: list[float] = []
    for index in range(discard + pairs):
        if index % 2 == 0:
            first, second = side_a(), side_b()
        else:
            second, first = side_b(), side_a()
        if index >= discard:
            a.append(first)
            b.append(second)
    return Paired(a=tuple(a), b=tuple(b))


@dataclass(frozen=True, slots=True, kw_only=True)
class Interval:
    """A distribution-free confidence interval of a median: two order statistics of the
    samples and the probability that the true median lies between them."""

    low: float
    high: float
    coverage: float


def median_interval(samples: Sequence[float], *, confidence: float = 0.95) -> Interval:
    """The narrowest interval [x(k), x(n+1-k)] of the sorted samples that holds the
    median with at least `confidence` (the binomial sign test's interval: each sample falls
    below the median with probability 1/2, whatever the distribution). With too few samples
    for `confidence`, the whole range and the coverage it has."""
    ordered = sorted(samples)
    n = len(ordered)
    if n == 0:
        raise ValueError("no samples")
    below = [math.comb(n, i) / 2**n for i in range(n + 1)]  # P(exactly i samples below)
    k, tail = 1, below[0]  # P(fewer than k samples below the median)
    while k < (n + 1) // 2 and tail + below[k] <= (1 - confidence) / 2:
        tail += below[k]
        k += 1
    return Interval(low=ordered[k - 1], high=ordered[n - k], coverage=1 - 2 * tail)
