"""A rank's wall clock against rank 0's, measured at the rendezvous over the default group, so
that each rank's events can be put on rank 0's clock and "first" means first across hosts."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

# Rounds of the clock exchange at the rendezvous; the one with the shortest round trip wins.
CLOCK_ROUNDS = 8


def measure_clock_offset(
    device: torch.device, wall: Callable[[], float], source: str | None
) -> tuple[float, float]:
    """This rank's wall clock minus rank 0's, and the round trip it was measured within.

    Each round: every rank at a barrier, rank 0 broadcasts its wall time, and each rank takes
    its own time before and after; rank 0's reading falls between them, and the midpoint is
    off by at most half the round trip. A rank whose clock has rank 0's `source` (one kernel)
    reads the same clock: its offset is 0, not the measurement's noise, so that ranks on one
    host order by their own stamps.
    """
    best: tuple[float, float] | None = None
    stamp = torch.zeros(2, dtype=torch.float64, device=device)
    mine = clock_source_id(source)
    for _ in range(CLOCK_ROUNDS):
        dist.barrier()
        before = wall()
        if dist.get_rank() == 0:
            stamp[0], stamp[1] = before, mine
        dist.broadcast(stamp, src=0)
        after = wall()
        trip = after - before
        offset = (before + after) / 2 - float(stamp[0].item())
        if best is None or trip < best[1]:
            best = (offset, trip)
    assert best is not None
    if dist.get_rank() == 0:
        return (0.0, 0.0)
    return (0.0, best[1]) if mine and int(stamp[1].item()) == mine else best


def clock_source_id(source: str | None) -> int:
    """A clock's source as a number a float64 holds exactly (48 bits, never 0); 0 for none."""
    if source is None:
        return 0
    digest = hashlib.blake2b(source.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") or 1
