"""A rank's clocks: the host's wall and monotonic clocks, the wall clock skewed for a rank that
LIFECYCLE_CLOCK_SKEW names (standing in for another host's clock in tests)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from lifecycle.core.errors import ConfigError


class Clock(Protocol):
    def wall(self) -> float: ...

    def mono_ns(self) -> int: ...

    def source(self) -> str | None: ...


# The running kernel's boot id: every process on one kernel reads one wall clock, in a
# container too (time namespaces move only the monotonic and boot clocks).
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


def kernel_boot_id() -> str | None:
    """This kernel's boot id; None where the system does not give one."""
    try:
        return BOOT_ID_PATH.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


class SystemClock:
    """The host's clocks. `skew_s` shifts the wall clock: LIFECYCLE_CLOCK_SKEW=RANK:SECONDS
    gives one rank a clock that is off, standing in for another host's (one host has one
    clock, so the alignment of ranks on different hosts is tested this way)."""

    def __init__(self, *, skew_s: float = 0.0) -> None:
        self._skew = skew_s

    def wall(self) -> float:
        return time.time() + self._skew

    def mono_ns(self) -> int:
        return time.monotonic_ns()

    def source(self) -> str | None:
        """Which wall clock this reads: the kernel's, by its boot id, as skewed; ranks whose
        clocks have one source need no measured offset. None where the kernel is not known."""
        boot = kernel_boot_id()
        return None if boot is None else f"{boot}{self._skew:+}"


CLOCK_SKEW_ENV = "LIFECYCLE_CLOCK_SKEW"
# Hosts whose clocks are further apart than a day are not what the alignment is tested for,
# and a skew of that size makes every duration measured before the alignment meaningless.
MAX_CLOCK_SKEW_S = 86_400.0


def clock_skews(spec: str, *, world_size: int) -> dict[int, float]:
    """The skew of each rank LIFECYCLE_CLOCK_SKEW names (`RANK:SECONDS[,...]`); ConfigError
    naming the variable on any entry that is not a rank of the world and a finite number of
    seconds within a day, so that no entry is silently ignored."""
    skews: dict[int, float] = {}
    if not spec.strip():
        return skews
    for part in spec.split(","):
        name, colon, seconds = (text.strip() for text in part.partition(":"))
        problem = None
        if not colon or not name.isascii() or not name.isdigit():
            problem = f"{part.strip()!r} is not RANK:SECONDS"
        elif int(name) >= world_size:
            problem = f"rank {int(name)} is outside 0..{world_size - 1}"
        elif int(name) in skews:
            problem = f"rank {int(name)} is named twice"
        else:
            try:
                skew = float(seconds)
            except ValueError:
                skew = math.nan
            if not math.isfinite(skew) or abs(skew) > MAX_CLOCK_SKEW_S:
                limit = f"{MAX_CLOCK_SKEW_S:g}"
                problem = f"{seconds!r} is not a number of seconds in -{limit}..{limit} (a day)"
            else:
                skews[int(name)] = skew
        if problem is not None:
            raise ConfigError(f"{CLOCK_SKEW_ENV}={spec[:80]!r}: {problem}", field="clock_skew")
    return skews


def clock_for(rank: int, env: Mapping[str, str], *, world_size: int) -> SystemClock:
    """This rank's clock, skewed where LIFECYCLE_CLOCK_SKEW names it (`RANK:SECONDS`)."""
    skews = clock_skews(env.get(CLOCK_SKEW_ENV, ""), world_size=world_size)
    return SystemClock(skew_s=skews.get(rank, 0.0))
