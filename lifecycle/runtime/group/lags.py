"""Each rank's lag entering a request's collectives against its peers, from the collective
records its ring keeps after ready: the group's members exchange when each entered the
request's collectives (one all-gather per group, at the request's end), and each rank keeps
its own median lag (docs/ranks.md, "Stragglers")."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lifecycle.core.decisions.stragglers import entry_lags
from lifecycle.core.format.records import GroupMark
from lifecycle.runtime.group.comm import Comm, RecordedGroup
from lifecycle.runtime.recorder import Recorder


@dataclass(frozen=True, slots=True)
class RankLag:
    seconds: float
    group: str


def request_lag(comm: Comm, recorder: Recorder, *, since: tuple[GroupMark, ...]) -> RankLag | None:
    """This rank's lag over the request that ran since the groups stood at `since`: in each
    of its parallel groups, the median over the request's collectives of how long after the
    first member it entered; the group where that is largest. None before ready (no ring:
    every rank of the group is before ready too), on one rank, or with nothing to compare."""
    if not recorder.ring_active:
        return None
    before = {mark.group: mark.started for mark in since}
    found: list[RankLag] = []
    for group in (comm.ulysses, comm.cfg):
        lag = _group_lag(group, recorder, first=before.get(group.name, -1) + 1)
        if lag is not None:
            found.append(RankLag(seconds=lag, group=group.name))
    return max(found, key=lambda each: each.seconds, default=None)


def _group_lag(group: RecordedGroup, recorder: Recorder, *, first: int) -> float | None:
    last = group.finished
    count = last - first + 1
    if group.size < 2 or count < 1:
        return None
    entered = recorder.ring_entries(group.name, first=first, last=last)
    mine = torch.tensor(
        [entered.get(seq, float("nan")) for seq in range(first, last + 1)], dtype=torch.float64
    )
    everyone = torch.empty((group.size, count), dtype=torch.float64)
    group.all_gather(everyone, mine, purpose="lag-exchange")
    lags = entry_lags(everyone.tolist())
    return lags[group.ranks.index(recorder.rank)]
