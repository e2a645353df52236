"""Flight Recorder entries joined with the journal: each entry placed in the lifecycle state
its rank was in, and the collectives a rank entered that a member of its group never did
(pure: the dumps are read by `replay.flight.dumps`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from lifecycle.core.format.fold import MAX_CLOCK_OFFSET_S
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from replay.flight.dumps import FlightDump, FlightDumps, FlightEntry
from replay.verdict.analysis import RunAnalysis
from replay.verdict.status import PendingInfo, RankVerdict, Status

# The purpose of a collective the lifecycle did not record (a pipeline's own).
UNRECORDED = "unrecorded"
# A recorded collective and a Flight Recorder entry this close in time (and in the same
# group) are the same collective.
SAME_COLLECTIVE_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinedEntry:
    rank: int
    entry: FlightEntry
    at: float  # on the journal's clock (rank 0's)
    state: str  # the lifecycle state the rank was in
    group: str | None  # the lifecycle group of its process group, where it is one


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightStuck:
    """A rank inside a collective (its latest in that process group) that members of the
    group never entered: it cannot have finished, whatever the ring says of it."""

    joined: JoinedEntry
    members: tuple[int, ...]
    waiting_for: tuple[int, ...]  # members whose dump shows they never entered it
    no_dump: tuple[int, ...]  # members without a dump: not known
    recorded: bool  # the journal holds it too, as the rank's pending collective

    @property
    def rank(self) -> int:
        return self.joined.rank


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightFacts:
    entries: tuple[JoinedEntry, ...]  # every rank's, in time order
    stuck: tuple[FlightStuck, ...]
    ranks: tuple[int, ...]  # the ranks with a dump
    sources: Mapping[int, tuple[str, ...]]  # each rank's dump files
    problems: tuple[str, ...]  # files that could not be read, one line each

    def stuck_of(self, rank: int) -> FlightStuck | None:
        """The rank's latest collective that peers never entered, if any."""
        found = [s for s in self.stuck if s.rank == rank]
        return max(found, key=lambda s: s.joined.at) if found else None


def _offset(view: RankView | None) -> float:
    clock = view.clock if view is not None else None
    if clock is None or abs(clock.offset_s) > MAX_CLOCK_OFFSET_S:
        return 0.0
    return clock.offset_s


def state_at(view: RankView | None, at: float) -> str:
    """The state `view`'s rank was in at `at` (journal clock)."""
    if view is None:
        return "?"
    current = State.CREATED.value
    for span in view.spans:
        if span.entered_at <= at:
            current = span.state
        else:
            break
    return current


def _torch_groups(view: RankView | None, world_size: int) -> dict[str, str]:
    """torch's process-group names → the lifecycle's groups, as the rank journaled them."""
    named: dict[str, str] = {"0": "world"} if world_size > 1 else {}
    for _, _, dumped in view.flight_dumps if view is not None else ():
        named.update((g.torch_name, g.group) for g in dumped.groups)
    return named


def _members(
    pg: str,
    group: str | None,
    dumps: Mapping[int, FlightDump],
    views: Mapping[int, RankView],
    world_size: int,
) -> tuple[int, ...]:
    """The members of process group `pg`: as a dump lists them, else as the lifecycle's group
    of that name, else every rank that has it in its ring."""
    for dump in dumps.values():
        if pg in dump.pg_ranks:
            return dump.pg_ranks[pg]
    if group == "world" or pg == "0":
        return tuple(range(world_size))
    for view in views.values():
        for progress in view.groups:
            if progress.group == group and progress.ranks:
                return progress.ranks
    return tuple(sorted(r for r, d in dumps.items() if any(e.pg_name == pg for e in d.entries)))


def _dumped_at(view: RankView | None) -> float | None:
    """When the rank last dumped its ring (journal clock), where the journal says."""
    walls = [at for at, _, d in (view.flight_dumps if view is not None else ()) if d.path]
    return max(walls) if walls else None


def _recorded(view: RankView | None, joined: JoinedEntry) -> bool:
    pending = view.pending if view is not None else None
    return (
        pending is not None
        and joined.group == pending.started.group
        and abs(pending.at - joined.at) <= SAME_COLLECTIVE_S
    )


def join(views: Mapping[int, RankView], dumps: FlightDumps, *, world_size: int) -> FlightFacts:
    entries: list[JoinedEntry] = []
    for rank, dump in dumps.by_rank.items():
        view = views.get(rank)
        offset = _offset(view)
        groups = _torch_groups(view, world_size)
        for entry in dump.entries:
            at = entry.created_s - offset
            entries.append(
                JoinedEntry(
                    rank=rank,
                    entry=entry,
                    at=at,
                    state=state_at(view, at),
                    group=groups.get(entry.pg_name),
                )
            )
    entries.sort(key=lambda j: (j.at, j.rank))
    return FlightFacts(
        entries=tuple(entries),
        stuck=_stuck(entries, dumps.by_rank, views, world_size),
        ranks=tuple(sorted(dumps.by_rank)),
        sources={rank: dump.paths for rank, dump in dumps.by_rank.items()},
        problems=dumps.problems,
    )


def _stuck(
    entries: list[JoinedEntry],
    dumps: Mapping[int, FlightDump],
    views: Mapping[int, RankView],
    world_size: int,
) -> tuple[FlightStuck, ...]:
    latest: dict[tuple[str, int], JoinedEntry] = {}  # (process group, rank) -> its latest
    for joined in entries:
        if joined.entry.is_p2p:
            continue
        key = (joined.entry.pg_name, joined.rank)
        if key not in latest or joined.entry.seq > latest[key].entry.seq:
            latest[key] = joined
    found = []
    for (pg, rank), joined in sorted(latest.items(), key=lambda kv: kv[1].at):
        members = _members(pg, joined.group, dumps, views, world_size)
        waiting, unknown = [], []
        for member in members:
            if member == rank:
                continue
            if member not in dumps:
                unknown.append(member)
                continue
            theirs = latest.get((pg, member))
            dumped = _dumped_at(views.get(member))
            # Only a dump taken after this rank entered says the member had not entered yet.
            late_enough = dumped is None or dumped >= joined.at
            if late_enough and (theirs is None or theirs.entry.seq < joined.entry.seq):
                waiting.append(member)
        if waiting:
            found.append(
                FlightStuck(
                    joined=joined,
                    members=members,
                    waiting_for=tuple(waiting),
                    no_dump=tuple(unknown),
                    recorded=_recorded(views.get(rank), joined),
                )
            )
    return tuple(found)


def in_flight(
    verdicts: dict[int, RankVerdict], facts: FlightFacts, analysis: RunAnalysis
) -> dict[int, RankVerdict]:
    """Ranks the journal shows in no collective, that the Flight Recorder shows inside one
    that peers never entered, wait there: as the journal would say had it been recorded."""
    updated = dict(verdicts)
    for rank, verdict in verdicts.items():
        stuck = facts.stuck_of(rank)
        if (
            stuck is None
            or stuck.recorded
            or verdict.pending is not None
            or verdict.status in (Status.CRASHED, Status.READY)
        ):
            continue
        joined, view = stuck.joined, analysis.views[rank]
        ended = next((at for at, _, e in view.errors if e.fatal and at >= joined.at), None)
        pending = PendingInfo(
            group=joined.entry.group_label,
            group_seq=joined.entry.seq,
            op=joined.entry.op,
            purpose=UNRECORDED,
            caller=joined.entry.caller,
            since_s=analysis.at(joined.at),
            waited_s=max(0.0, (ended or view.last_wall or joined.at) - joined.at),
            waiting_for=stuck.waiting_for,
            from_flight_recorder=True,
            state=joined.state,
            timeout_s=joined.entry.timeout_s,
        )
        status = verdict.status if verdict.status is Status.FAILED else Status.BLOCKED
        updated[rank] = replace(verdict, pending=pending, status=status)
    return updated
