"""Across hosts, each rank's fixed exchange with its places on the other hosts (docs/ranks.md,
"The gate checks the ranks"): the pairwise link between nodes that a group's all-to-all, within
a host more often than not, does not measure."""

from __future__ import annotations

import math
import time

import torch

from lifecycle.core.decisions.rankcheck import CROSS_HOST, Partners
from lifecycle.core.format.kinds.rankevents import LinkFigure
from lifecycle.runtime.device import synchronize
from lifecycle.runtime.group.comm import Comm

# Each rank sends this many float32 to its place on the next host (as a member of a group's
# all-to-all does to each peer, runtime.group.gatecheck), timed this many times after one that
# lines the ranks up (the best counts).
LINK_ELEMENTS_PER_PEER = 65536
LINK_REPEATS = 2
# The exchange across hosts is each rank's own figure, not a group's: timed more often, so that
# a rank that entered one repetition late (on a loaded host) is not taken for a slow link.
CROSS_HOST_REPEATS = 5


def probe_cross_host(comm: Comm, partners: Partners) -> float | None:
    """Across hosts, this rank's fixed exchange with its places on the next host and the one
    before (an uneven all-to-all of the world, in which every rank takes part, a rank with no
    partner too): one that lines the ranks up, then the best of CROSS_HOST_REPEATS; None for a rank
    that has no partner. Each rank keeps one element of its own, so no buffer is empty."""
    world, rank = comm.world, comm.world.ranks.index(comm.layout.rank)
    sends, receives = [0] * world.size, [0] * world.size
    sends[rank] = receives[rank] = 1
    if partners.to is not None:
        sends[partners.to] += LINK_ELEMENTS_PER_PEER
    if partners.from_ is not None:
        receives[partners.from_] += LINK_ELEMENTS_PER_PEER
    inp = torch.ones(sum(sends), dtype=torch.float32, device=comm.device)
    out = torch.empty(sum(receives), dtype=torch.float32, device=comm.device)
    splits = {"input_splits": tuple(sends), "output_splits": tuple(receives)}
    world.exchange(out, inp, purpose="cross-host-probe", **splits)
    best = float("inf")
    for _ in range(CROSS_HOST_REPEATS):
        started = time.perf_counter()
        world.exchange(out, inp, purpose="cross-host-probe", **splits)
        synchronize(comm.device)
        best = min(best, time.perf_counter() - started)
    return None if partners.to is None and partners.from_ is None else best


def crossing_figure(partners: Partners | None, seconds: float | None) -> tuple[LinkFigure, ...]:
    """The exchange across hosts as the journal keeps it, among the links: named by the rank
    sent to (else the one received from)."""
    if partners is None or seconds is None:
        return ()
    named = f"to rank {partners.to}" if partners.to is not None else f"from rank {partners.from_}"
    sent = 4 * LINK_ELEMENTS_PER_PEER * (partners.to is not None)
    return (
        LinkFigure(
            group=f"{CROSS_HOST} {named}",
            seconds=seconds if math.isfinite(seconds) else -1.0,
            bytes=sent,
        ),
    )
