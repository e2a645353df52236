"""What `replay show` says of gate-check's check of the ranks: each host's environment once,
and per rank its probes' figures, its slow findings, the fields it differs in, and whether it
straggled while serving; as text and as data (pure)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from lifecycle.core.decisions.stragglers import Straggler
from lifecycle.core.format import events as ev
from lifecycle.core.format.kinds.rankevents import EnvironmentDifference, RankEnvironment
from lifecycle.core.format.text import clean
from lifecycle.core.format.view import RankView
from lifecycle.verdict.rankchecks import group_differences, serving_straggler
from replay.verdict.rankchecks import (
    difference_text,
    environment_text,
    gflops,
    probe_text,
    slow_text,
    straggler_text,
)

Checked = TypeVar("Checked", bound=ev.RankCheckEvent)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostEnvironment:
    """The ranks of one host that run on the same environment."""

    host: str
    ranks: tuple[int, ...]
    environment: RankEnvironment


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupChecks:
    """What the check of the ranks says of the group as a whole, found once for every rank's
    lines (a run of a thousand ranks is shown rank by rank): the fields its ranks differ in,
    and its straggler while serving."""

    differences: tuple[EnvironmentDifference, ...]
    straggler: Straggler | None

    def differences_of(self, rank: int) -> list[tuple[EnvironmentDifference, str]]:
        """Each field `rank` differs from the group in, with its value (a journal's ranks
        without a value, or values without a rank, are left out rather than raised on)."""
        return [
            (d, value)
            for d in self.differences
            for r, value in zip(d.ranks, d.values, strict=False)
            if r == rank
        ]


def group_checks(views: Mapping[int, RankView]) -> GroupChecks:
    return GroupChecks(differences=group_differences(views), straggler=serving_straggler(views))


def _checks(view: RankView, kind: type[Checked]) -> list[Checked]:
    """The rank's check events of one kind, in the order it journaled them."""
    return [event for _, _, event in view.rank_checks if isinstance(event, kind)]


def host_environments(
    views: Mapping[int, RankView], chosen: Collection[int] | None = None
) -> list[HostEnvironment]:
    """Each host's environment with the ranks that run on it, by host and lowest rank: a rank
    of the host that runs on another (another torch) has a line of its own."""
    grouped: dict[RankEnvironment, list[int]] = {}
    for rank in sorted(views):
        if chosen is not None and rank not in chosen:
            continue
        for checked in _checks(views[rank], ev.EnvironmentChecked):
            grouped.setdefault(checked.environment, []).append(rank)
    found = [
        HostEnvironment(host=environment.host, ranks=tuple(ranks), environment=environment)
        for environment, ranks in grouped.items()
    ]
    return sorted(found, key=lambda h: (h.host, h.ranks))


def host_lines(views: Mapping[int, RankView], chosen: Collection[int] | None = None) -> list[str]:
    """'host vm (ranks 0, 1): torch 2.13.0+cpu, python 3.11.7, cpu AMD EPYC (AVX2), ...'."""
    lines = []
    for h in host_environments(views, chosen):
        which = ("rank " if len(h.ranks) == 1 else "ranks ") + ", ".join(map(str, h.ranks))
        host = h.host or "?"
        lines.append(clean(f"host {host} ({which}): {environment_text(h.environment)}"))
    return lines


def rank_check_lines(view: RankView, checks: GroupChecks) -> list[str]:
    """One rank's probe figures, slow findings, differences from its group, and the straggler
    line when it is the one late while serving."""
    lines = [f"  gate-check probe: {probe_text(probed)}" for probed in _checks(view, ev.RankProbed)]
    for probed in _checks(view, ev.RankProbed):
        if probed.diagnostics:
            lines.append(
                f"  NCCL diagnostics: {len(probed.diagnostics)} characters journaled (show --json)"
            )
    lines.extend(f"  gate-check slow: {slow_text(slow)}" for slow in _checks(view, ev.SlowRank))
    lines.extend(
        "  environment differs: "
        + difference_text(d.field, value, d.expected, d.expected_ranks, matters=d.matters)
        for d, value in checks.differences_of(view.rank)
    )
    late = checks.straggler
    if late is not None and late.rank == view.rank:
        lines.append(f"  straggler: {straggler_text(late.group, late.median_lag_s, late.requests)}")
    return [clean(line) for line in lines]


def hosts_json(
    views: Mapping[int, RankView], chosen: Collection[int] | None = None
) -> list[dict[str, Any]]:
    return [
        {"host": h.host, "ranks": list(h.ranks), "environment": dataclasses.asdict(h.environment)}
        for h in host_environments(views, chosen)
    ]


def _probe_json(probed: ev.RankProbed) -> dict[str, Any]:
    return {
        "host": probed.host,
        "device": probed.device,
        "compute_s": probed.compute_s,
        "compute_flop": probed.compute_flop,
        "gflops": gflops(probed.compute_flop, probed.compute_s),
        "links": [
            {"group": link.group, "seconds": link.seconds, "bytes": link.bytes}
            for link in probed.links
        ],
        "diagnostics": probed.diagnostics,
    }


def _straggler_json(late: Straggler | None, rank: int) -> dict[str, Any] | None:
    if late is None or late.rank != rank:
        return None
    return {"group": late.group, "median_lag_s": late.median_lag_s, "requests": late.requests}


def rank_checks_json(view: RankView, checks: GroupChecks) -> dict[str, Any]:
    """One rank's part of the check of the ranks as data, for `replay show --json`."""
    checked = _checks(view, ev.EnvironmentChecked)
    return {
        "environment": dataclasses.asdict(checked[0].environment) if checked else None,
        "differences": [
            {
                "field": d.field,
                "value": value,
                "expected": d.expected,
                "expected_ranks": list(d.expected_ranks),
                "matters": d.matters,
            }
            for d, value in checks.differences_of(view.rank)
        ],
        "probes": [_probe_json(probed) for probed in _checks(view, ev.RankProbed)],
        "slow": [
            {f.name: getattr(slow, f.name) for f in dataclasses.fields(slow)}
            for slow in _checks(view, ev.SlowRank)
        ],
        "straggler": _straggler_json(checks.straggler, view.rank),
        "lags": [{"lag_s": lag.lag_s, "group": lag.group} for lag in view.lags],
    }
