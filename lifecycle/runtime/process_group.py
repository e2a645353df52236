"""Joining and leaving the torch.distributed group of a run: written once, for the rank
session and for the run-id agreement under torchrun."""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Callable, Iterable, Mapping
from traceback import extract_tb
from typing import Any

import torch
import torch.distributed as dist

from lifecycle.core.agreement import (
    describe_disagreements,
    disagreements,
    settings_digest,
    shared_settings,
)
from lifecycle.core.config import ServerArgs, args_to_json
from lifecycle.core.errors import (
    CollectiveError,
    CollectiveTimeout,
    LifecycleError,
    PeerGone,
    RankDisagreement,
    RendezvousFailed,
)
from lifecycle.core.events import Error, error_event

# Joining the group (rendezvous through the store, creating subgroups) may take longer than one
# collective may: rank processes start torch at different speeds on a loaded host. Once joined,
# `bound_collectives` puts every group the lifecycle made back to --dist-timeout.
RENDEZVOUS_TIMEOUT_S = 120.0


def rendezvous_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S))


def new_group(ranks: tuple[int, ...], timeout_s: float) -> Any:
    """A subgroup of `ranks` (every rank must call this, in the same order)."""
    return dist.new_group(list(ranks), timeout=rendezvous_timeout(timeout_s))


def bound_collectives(groups: Iterable[Any], timeout_s: float) -> None:
    """Bound every collective on `groups` by `timeout_s` from now on: the rendezvous's longer
    timeout was for joining, and a pipeline's own collectives on the default group would
    otherwise wait that long."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in groups:
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


# What gloo (and the kernel, through it) says when a peer's end of the connection went away.
PEER_GONE_MARKERS = ("closed by peer", "reset by peer", "connection closed", "connection reset")


def failure_class(message: str, *, timed_out: bool = False) -> type[CollectiveError]:
    """How a torch.distributed call failed, decided once when the error is recorded: torch
    says it only in its message text, and what reads the journal must not have to."""
    text = message.lower()
    if timed_out or "timed out" in text or "timeout" in text:
        return CollectiveTimeout
    if any(marker in text for marker in PEER_GONE_MARKERS):
        return PeerGone
    return CollectiveError


def fatal_error(exc: BaseException, *, traceback: str) -> Error:
    """The record of a rank's fatal error. One torch.distributed raised outside the recorder (a
    pipeline's own collective, which only the Flight Recorder sees) is classified as the
    recorder's own are, by what torch says."""
    event = error_event(exc, fatal=True, trigger=None, traceback=traceback)
    if isinstance(exc, LifecycleError) or not isinstance(exc, RuntimeError):
        return event
    frames = extract_tb(exc.__traceback__)
    if not any("torch/distributed/" in f.filename.replace("\\", "/") for f in frames):
        return event
    return dataclasses.replace(event, error_kind=failure_class(str(exc)).error_kind.value)


def torch_group_name(group: Any) -> str | None:
    """torch's name for a process group ("0" for the default one), as its Flight Recorder
    names it; None for no group."""
    if group is None:
        return None
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(
    *,
    device: torch.device,
    rank: int,
    world_size: int,
    dist_timeout_s: float,
    env: Mapping[str, str],
) -> None:
    """Join the run's group through MASTER_ADDR/MASTER_PORT (a no-op once joined); a failure
    to join is one line naming the address and the cause."""
    if dist.is_initialized():
        return
    try:
        dist.init_process_group(
            backend=backend_for(device),
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=rendezvous_timeout(dist_timeout_s),
        )
    except (RuntimeError, ValueError) as exc:  # torch's DistError family, a bad port
        raise rendezvous_failure(exc, env) from None


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def rendezvous_failure(exc: BaseException, env: Mapping[str, str]) -> RendezvousFailed:
    """torch's error from joining a process group, as one line: the address and the cause."""
    text = str(exc)
    detail = re.search(r"message: ([^\n]+)", text)
    lines = text.strip().splitlines()
    reason = detail.group(1).strip() if detail else lines[0] if lines else type(exc).__name__
    return RendezvousFailed(
        address=env.get("MASTER_ADDR", "?"), port=env.get("MASTER_PORT", "?"), reason=reason[:200]
    )


# Rounds of the clock exchange at the rendezvous; the one with the shortest round trip wins.
CLOCK_ROUNDS = 8


def measure_clock_offset(device: torch.device, wall: Callable[[], float]) -> tuple[float, float]:
    """This rank's wall clock minus rank 0's, and the round trip it was measured within.

    Each round: every rank at a barrier, rank 0 broadcasts its wall time, and each rank takes
    its own time before and after; rank 0's reading falls between them, and the midpoint is
    off by at most half the round trip.
    """
    best: tuple[float, float] | None = None
    stamp = torch.zeros(1, dtype=torch.float64, device=device)
    for _ in range(CLOCK_ROUNDS):
        dist.barrier()
        before = wall()
        if dist.get_rank() == 0:
            stamp.fill_(before)
        dist.broadcast(stamp, src=0)
        after = wall()
        trip = after - before
        offset = (before + after) / 2 - float(stamp.item())
        if best is None or trip < best[1]:
            best = (offset, trip)
    assert best is not None
    return (0.0, 0.0) if dist.get_rank() == 0 else best


# Where each rank posts its shared settings, and their digest, in the rendezvous store.
SETTINGS_KEY = "lifecycle-settings"


def settings_disagreement(args: ServerArgs, *, rank: int, run_id: str) -> RankDisagreement | None:
    """At the rendezvous, what the ranks' settings differ in (None when they all match): each
    rank's own command line parsed into `args`, of which the run records one rank's.

    They go through the rendezvous store, not a collective: every collective the lifecycle
    runs is recorded, and its recorder is not set up yet. Each rank posts its settings, then
    their digest; every rank reads the digests, and only when they differ the settings, so
    every rank takes the same branch and names the same settings and ranks. A read waits for
    a peer's post at most the rendezvous timeout.
    """
    settings = shared_settings(args_to_json(args))
    # torch's own store of the default group: no public way to it.
    store = dist.distributed_c10d._get_default_store()
    prefix = f"{SETTINGS_KEY}/{run_id}/"
    store.set(f"{prefix}{rank}", json.dumps(settings))  # in the order ServerArgs has them
    store.set(f"{prefix}{rank}/digest", str(settings_digest(settings)))
    ranks = range(dist.get_world_size())
    digests = {store.get(f"{prefix}{peer}/digest") for peer in ranks}
    if len(digests) == 1:
        return None
    found = disagreements([json.loads(store.get(f"{prefix}{peer}")) for peer in ranks])
    return RankDisagreement(
        f"the ranks were started with different settings: {describe_disagreements(found)}",
        rank=rank,
    )
