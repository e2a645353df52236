"""Gate-check's check of the ranks themselves (pure): what their environments differ in, which
rank's probe figures cannot be used, and which rank is slow against its group's median
(docs/ranks.md, "The gate checks the ranks")."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.kinds.rankevents import EnvironmentDifference, RankEnvironment

# The fields whose disagreement changes numerics or collectives: the startup fails on them.
# The others (a driver's patch level, the device's memory, Python, the device's name) are
# journaled and warned of.
MATTERING = frozenset({"torch", "cuda", "nccl", "dtype", "capability"})
# The host differs by design.
_COMPARED = tuple(f.name for f in fields(RankEnvironment) if f.name != "host")
DEFAULT_SLOW_RANK_THRESHOLD = 0.7
# A test hook, for tests only: `RANK:FIELD=VALUE[,...]` makes that rank report VALUE for a
# field of its environment (another torch, another NCCL), as a rank started elsewhere would.
TEST_ENVIRONMENT_ENV = "LIFECYCLE_TEST_RANK_ENVIRONMENT"
# The measure's group of an exchange between hosts (across nodes), by rank pairs.
CROSS_HOST = "cross-host"


def environment_differences(
    environments: Sequence[RankEnvironment],
) -> tuple[EnvironmentDifference, ...]:
    """Each field the ranks (`environments[r]` is rank r's) differ in: the value most ranks
    have (rank 0's when two values are as common), and the other ranks with theirs."""
    found: list[EnvironmentDifference] = []
    for name in _COMPARED:
        by_value: dict[str, list[int]] = {}
        for rank, environment in enumerate(environments):
            by_value.setdefault(str(getattr(environment, name)), []).append(rank)
        if len(by_value) < 2:
            continue
        # Most ranks first; on a tie, the value of the lowest rank (rank 0's verdict).
        expected = min(by_value, key=lambda v: (-len(by_value[v]), by_value[v][0]))
        others = sorted(
            (rank, value)
            for value, ranks in by_value.items()
            if value != expected
            for rank in ranks
        )
        found.append(
            EnvironmentDifference(
                field=name,
                matters=name in MATTERING,
                expected=expected,
                expected_ranks=tuple(by_value[expected]),
                ranks=tuple(rank for rank, _ in others),
                values=tuple(value for _, value in others),
            )
        )
    return tuple(found)


def as_told(found: RankEnvironment, *, rank: int, text: str) -> RankEnvironment:
    """`found` with what the test hook tells this rank to report instead; a field the hook
    names that is not one, or a size that is not a number, is refused naming the hook."""
    names = [f.name for f in fields(RankEnvironment)]
    told: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        where, _, assignment = item.partition(":")
        name, _, value = assignment.partition("=")
        if name not in names:
            raise ConfigError(
                f"{TEST_ENVIRONMENT_ENV}: {item!r}: no field {name!r} (the fields: "
                f"{', '.join(names)})"
            )
        if name == "memory_bytes" and not value.isdigit():
            raise ConfigError(f"{TEST_ENVIRONMENT_ENV}: {item!r}: memory_bytes is a number")
        if where.strip() == str(rank):
            told[name] = int(value) if name == "memory_bytes" else value
    return replace(found, **told) if told else found  # type: ignore[arg-type]


def describe_difference(difference: EnvironmentDifference) -> str:
    """'rank 1 runs torch 2.99.0; ranks 0, 2, 3 run 2.13.0' ("" for a value shows as none)."""
    odd = "; ".join(
        f"rank {rank} runs {difference.field} {value or 'none'}"
        for rank, value in zip(difference.ranks, difference.values, strict=False)
    )
    run = "runs" if len(difference.expected_ranks) == 1 else "run"
    return f"{odd}; {_ranks(difference.expected_ranks)} {run} {difference.expected or 'none'}"


def environment_failure(differences: Sequence[EnvironmentDifference]) -> str | None:
    """The one line a startup fails with when a difference matters; None when none does."""
    mattering = [d for d in differences if d.matters]
    if not mattering:
        return None
    culprits = sorted({rank for d in mattering for rank in d.ranks})
    return (
        "the ranks' environments differ in what changes numerics or collectives: "
        + "; ".join(describe_difference(d) for d in mattering)
        + f" (culprit: {_ranks(tuple(culprits))})"
    )


def _ranks(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeFigures:
    """One rank's probe figures, as every rank has them after the gather: the fixed matmul's
    best seconds, and each of its groups' all-to-all seconds by group name."""

    rank: int
    compute_s: float
    links: Mapping[str, float]
    cross_host_s: float | None = None  # its exchange with its places on the other hosts


@dataclass(frozen=True, slots=True)
class Partners:
    """A rank's exchange across hosts: the rank it sends to (its place on the next host) and
    the one it receives from (its place on the host before); None where that host has no rank
    at its place."""

    to: int | None
    from_: int | None


def cross_host_partners(environments: Sequence[RankEnvironment]) -> dict[int, Partners]:
    """Across hosts (the group spans more than one), each rank's partners: hosts in the order
    of their lowest rank, a rank's place its index among its host's ranks; on one host, none.
    Every send has its receive: the rank a rank sends to receives from it."""
    hosts: dict[str, list[int]] = {}
    for rank, environment in enumerate(environments):
        hosts.setdefault(environment.host, []).append(rank)
    if len(hosts) < 2:
        return {}
    placed = list(hosts.values())
    partners = {}
    for index, ranks in enumerate(placed):
        after, before = placed[(index + 1) % len(placed)], placed[index - 1]
        for place, rank in enumerate(ranks):
            partners[rank] = Partners(
                to=after[place] if place < len(after) else None,
                from_=before[place] if place < len(before) else None,
            )
    return partners


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowFinding:
    """A rank below the threshold: in compute (group "world") or in a group's link."""

    rank: int
    measure: str
    group: str
    figure_s: float
    median_s: float
    ratio: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Unusable:
    rank: int
    line: str


def unusable_figure(figures: Sequence[ProbeFigures]) -> Unusable | None:
    """The first rank whose figure is zero, negative or not a number (a clock gone
    backwards, a device that errored), with the one line naming it: no speed can be made of
    it."""
    for each in figures:
        links = [(f"{group}'s all-to-all", s) for group, s in each.links.items()]
        measured = [("compute", each.compute_s), *links]
        if each.cross_host_s is not None:
            measured.append((f"{CROSS_HOST} exchange", each.cross_host_s))
        for what, seconds in measured:
            if not (math.isfinite(seconds) and seconds > 0):
                return Unusable(
                    rank=each.rank,
                    line=f"rank {each.rank}'s {what} probe measured {seconds!r} s: not a time a"
                    " speed can be made of (a clock that went backwards, or a device that"
                    " errored)",
                )
    return None


def slow_findings(figures: Sequence[ProbeFigures], *, threshold: float) -> tuple[SlowFinding, ...]:
    """The ranks whose speed (the inverse of a figure) is below `threshold` of the median
    speed: in compute, against every rank; in a link, a group against the groups of its kind
    (ulysses against ulysses), each of its members named (those of them slow in compute, where
    any is), and a rank's exchange across hosts against every other rank's. A kind with one
    group has nothing to be compared with. Figures must be usable (see unusable_figure)."""
    found: list[SlowFinding] = []
    if len(figures) > 1:
        found.extend(_below("compute", "world", {f.rank: f.compute_s for f in figures}, threshold))
    computing_slowly = {finding.rank for finding in found}
    groups: dict[str, list[float]] = {}
    members: dict[str, list[int]] = {}
    for each in figures:
        for group, seconds in each.links.items():
            groups.setdefault(group, []).append(seconds)
            members.setdefault(group, []).append(each.rank)
    by_kind: dict[str, dict[str, float]] = {}
    for group, times in groups.items():
        by_kind.setdefault(group.rstrip("0123456789"), {})[group] = statistics.median(times)
    for kind_groups in by_kind.values():
        if len(kind_groups) < 2:
            continue
        for slow in _below("link", "", kind_groups, threshold):
            # A member slow in compute is why its group's all-to-all is slow: it is named,
            # not the members that waited for it.
            named = [r for r in members[slow.group] if r in computing_slowly]
            found.extend(replace(slow, rank=rank) for rank in named or members[slow.group])
    crossing = {f.rank: f.cross_host_s for f in figures if f.cross_host_s is not None}
    if len(crossing) > 1:  # each rank's exchange across hosts against every other's
        found.extend(_below("link", CROSS_HOST, crossing, threshold))
    return tuple(found)


def best_of(first: Sequence[ProbeFigures], again: Sequence[ProbeFigures]) -> list[ProbeFigures]:
    """Each rank's best (least) figure of two rounds of the probes, measure by measure: a
    rank found slow is measured again, every rank with it, and is slow only where it was so
    both times (a host's other work, which stalls one round, seldom stalls two)."""
    best = []
    for one, other in zip(first, again, strict=True):
        crossing = one.cross_host_s
        if crossing is not None and other.cross_host_s is not None:
            crossing = min(crossing, other.cross_host_s)
        best.append(
            ProbeFigures(
                rank=one.rank,
                compute_s=min(one.compute_s, other.compute_s),
                links={g: min(s, other.links.get(g, s)) for g, s in one.links.items()},
                cross_host_s=crossing,
            )
        )
    return best


def _below(
    measure: str, group: str, seconds: Mapping[int, float] | Mapping[str, float], threshold: float
) -> list[SlowFinding]:
    """Each key whose speed is below `threshold` of the median speed (a rank, or a group)."""
    median_s = 1.0 / statistics.median(1.0 / s for s in seconds.values())
    slow = []
    for key, figure in seconds.items():
        ratio = median_s / figure
        if ratio < threshold:
            slow.append(
                SlowFinding(
                    rank=key if isinstance(key, int) else -1,
                    measure=measure,
                    group=group or str(key),
                    figure_s=figure,
                    median_s=median_s,
                    ratio=ratio,
                )
            )
    return slow


def describe_slow(finding: SlowFinding, *, threshold: float) -> str:
    """'rank 1's compute took 12.1 ms, 0.25 of the median's 3.0 ms (threshold 0.7)'."""
    what = f"{finding.group} all-to-all"
    if finding.measure == "compute":
        what = "compute"
    elif finding.group == CROSS_HOST:
        what = f"{CROSS_HOST} exchange"
    return (
        f"rank {finding.rank}'s {what} took {finding.figure_s * 1e3:.1f} ms, {finding.ratio:.2f}"
        f" of the median's speed ({finding.median_s * 1e3:.1f} ms; threshold {threshold:g})"
    )
