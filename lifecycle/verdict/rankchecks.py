"""What gate-check's check of the ranks and the requests' lags say of each rank (pure): the
environment fields it differs in, its slow figures, a straggler while serving; and the ranks
a startup that failed the check names."""

from __future__ import annotations

from collections.abc import Mapping

from lifecycle.core.decisions.stragglers import Straggler, straggler
from lifecycle.core.format import events as ev
from lifecycle.core.format.kinds.rankevents import EnvironmentDifference
from lifecycle.core.format.view import RankView
from lifecycle.verdict.evidence import EnvironmentDiffers, Evidence, SlowAtGate, Straggling


def rank_check_evidence(views: Mapping[int, RankView]) -> list[Evidence]:
    """Each rank's environment differences (as the lowest rank that journaled them saw the
    group's), its slow figures at gate-check, then the straggler while serving, if any."""
    found: list[Evidence] = []
    for difference in group_differences(views):
        # A journal's record is read as written: ranks and values of unequal length (a
        # corrupt or foreign row) pair as far as both go.
        for rank, value in zip(difference.ranks, difference.values, strict=False):
            found.append(
                EnvironmentDiffers(
                    rank=rank,
                    field=difference.field,
                    value=value,
                    expected=difference.expected,
                    matters=difference.matters,
                )
            )
    for rank in sorted(views):
        for _, _, event in views[rank].rank_checks:
            if isinstance(event, ev.SlowRank):
                found.append(
                    SlowAtGate(
                        rank=rank,
                        measure=event.measure,
                        group=event.group,
                        figure_s=event.figure_s,
                        median_s=event.median_s,
                        ratio=event.ratio,
                        threshold=event.threshold,
                        action=event.action,
                    )
                )
    late = serving_straggler(views)
    if late is not None:
        found.append(
            Straggling(
                rank=late.rank,
                group=late.group,
                median_lag_s=late.median_lag_s,
                requests=late.requests,
            )
        )
    return found


def group_differences(views: Mapping[int, RankView]) -> tuple[EnvironmentDifference, ...]:
    """The fields the group's ranks differ in, from the lowest rank that journaled them (every
    rank journals the same)."""
    return next(
        (
            event.differences
            for rank in sorted(views)
            for _, _, event in views[rank].rank_checks
            if isinstance(event, ev.EnvironmentChecked)
        ),
        (),
    )


def serving_straggler(views: Mapping[int, RankView]) -> Straggler | None:
    """The rank consistently late over its latest requests, if one is."""
    return straggler(
        {rank: [(lag.lag_s, lag.group) for lag in v.lags] for rank, v in views.items()}
    )


def rank_check_culprits(views: Mapping[int, RankView]) -> list[int]:
    """The ranks a failed check of the ranks names: those whose environment differs in what
    matters, those slow under --on-slow-rank fail, those whose probe figure is not a time."""
    named: set[int] = set()
    for item in rank_check_evidence(views):
        if (isinstance(item, EnvironmentDiffers) and item.matters) or (
            isinstance(item, SlowAtGate) and item.action == "fail"
        ):
            named.add(item.rank)
    for rank, view in views.items():
        for _, _, event in view.rank_checks:
            if isinstance(event, ev.RankProbed) and (
                event.compute_s <= 0 or any(link.seconds <= 0 for link in event.links)
            ):
                named.add(rank)
    return sorted(named)
