"""One pass over a run's events: each rank's fold, and the collective evidence across ranks."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.records import Signature
from lifecycle.core.format.view import RankView


class Run(Protocol):
    """What a verdict reads of a run: its id, its start, its world and a few of its settings.
    `replay` reads it from the journal's run row; the launcher knows it as its own
    (`lifecycle.verdict.launched.LaunchedRun`)."""

    @property
    def run_id(self) -> str: ...

    @property
    def created_at(self) -> float: ...

    @property
    def world_size(self) -> int: ...

    def config_number(self, key: str, default: float | None) -> float | None: ...


RunT_co = TypeVar("RunT_co", bound=Run, covariant=True)
RunT = TypeVar("RunT", bound=Run)


def config_number(config: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """A positive, finite number from a run's recorded settings, else `default`."""
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value) if math.isfinite(value) and value > 0 else default


class MismatchReason(StrEnum):
    OPS = "different-ops"
    TYPES_OR_SHAPES = "different-types-or-shapes"
    SPLIT_LENGTHS = "split-lengths"  # all-to-all split lists of different lengths
    SPLIT_SIZES = "split-sizes"  # what one member sends a peer is not what the peer expects


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitDisagreement:
    """All-to-all: `sender` sends `sends` elements to `receiver`, which expects `expects`."""

    sender: int
    receiver: int
    sends: int
    expects: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatch:
    """Members of a group that ran different collectives at the same sequence number."""

    group: str
    group_seq: int
    by_rank: tuple[tuple[int, Signature], ...]
    reason: MismatchReason
    split: SplitDisagreement | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupEvidence:
    """Per group: each member's highest started and finished sequence numbers."""

    group: str
    members: tuple[int, ...]
    started: tuple[tuple[int, int], ...]  # (rank, highest seq started; -1 for none)
    finished: tuple[tuple[int, int], ...]
    # (rank, seq, wall time started) of each member's last few collectives in this group
    recent_starts: tuple[tuple[int, int, float], ...] = ()

    def started_by(self, rank: int) -> int:
        return dict(self.started).get(rank, -1)

    def started_at(self, rank: int, seq: int) -> float | None:
        return next((w for r, s, w in self.recent_starts if r == rank and s == seq), None)

    def finished_by(self, rank: int) -> int:
        return dict(self.finished).get(rank, -1)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunAnalysis(Generic[RunT_co]):
    run: RunT_co
    views: dict[int, RankView]
    groups: dict[str, GroupEvidence]
    mismatches: tuple[Mismatch, ...]
    last_progress: dict[int, float]  # each rank's last event that is neither heartbeat nor shutdown
    end_wall: float  # the last event of any rank
    missing_ranks: tuple[int, ...]  # ranks of the world that left no event at all
    events: int
    recent_heartbeats: dict[int, tuple[float, ...]] = field(default_factory=dict)
    shutdown_walls: dict[int, float] = field(default_factory=dict)  # when each rank shut down

    def heartbeats_after(self, wall: float, *, besides: int) -> int:
        """How many of the other ranks' last heartbeats came after `wall`."""
        return sum(
            1
            for rank, beats in self.recent_heartbeats.items()
            if rank != besides
            for at in beats
            if at > wall
        )

    @property
    def heartbeat_interval_s(self) -> float:
        return self.run.config_number("heartbeat_interval_s", 1.0) or 1.0

    @property
    def dist_timeout_s(self) -> float | None:
        return self.run.config_number("dist_timeout_s", None)

    @property
    def state_deadline_s(self) -> float:
        return self.run.config_number("state_deadline_s", 300.0) or 300.0

    def at(self, wall: float) -> float:
        """Seconds since the run was created."""
        return wall - self.run.created_at


def _mismatches(
    views: Mapping[int, RankView], members: dict[str, tuple[int, ...]]
) -> list[Mismatch]:
    """Members of a group whose latest collectives differ at one sequence number.

    Compared over what each fold keeps of its rank's latest collectives per group
    (RECENT_STARTS): the mismatch that explains how a run ended is at its end, and a check
    whose cost does not grow with the run's length is one a fold summary can answer too.
    """
    found: list[Mismatch] = []
    for name, ranks in sorted(members.items()):
        by_seq: dict[int, dict[int, Signature]] = {}
        for rank, view in views.items():
            for group, starts in view.recent_starts:
                if group == name:
                    for start in starts:
                        by_seq.setdefault(start.seq, {})[rank] = start.signature
        for seq, signatures in sorted(by_seq.items()):
            if len(signatures) > 1:
                mismatch = _check(name, seq, signatures, ranks)
                if mismatch is not None:
                    found.append(mismatch)
    return found


def _check(
    group: str, seq: int, signatures: dict[int, Signature], members: tuple[int, ...]
) -> Mismatch | None:
    distinct = {(s.op, s.purpose, s.dtype, s.shapes) for s in signatures.values()}
    split = None
    if len(distinct) > 1:
        ops = {s.op for s in signatures.values()}
        reason: MismatchReason | None = (
            MismatchReason.OPS if len(ops) > 1 else MismatchReason.TYPES_OR_SHAPES
        )
    else:
        reason, split = _split_mismatch(signatures, members)
    if reason is None:
        return None
    return Mismatch(
        group=group,
        group_seq=seq,
        by_rank=tuple(sorted(signatures.items())),
        reason=reason,
        split=split,
    )


def _split_mismatch(
    signatures: dict[int, Signature], members: tuple[int, ...]
) -> tuple[MismatchReason | None, SplitDisagreement | None]:
    """For all-to-all: what rank r sends to peer j must be what j expects from r."""
    splits = {(s.input_splits, s.output_splits) for s in signatures.values()}
    if len(splits) == 1:
        inputs, outputs = next(iter(splits))
        if inputs is None or (inputs == outputs and len(set(inputs)) <= 1):
            return None, None  # equal splits everywhere (the common case) pair by construction
    index = {rank: i for i, rank in enumerate(members)}
    for rank, sig in signatures.items():
        if sig.input_splits is None:
            continue
        for peer, peer_sig in signatures.items():
            if peer_sig.output_splits is None:
                continue
            j, r = index.get(peer), index.get(rank)
            if j is None or r is None:
                continue
            if j >= len(sig.input_splits) or r >= len(peer_sig.output_splits):
                return MismatchReason.SPLIT_LENGTHS, None
            if sig.input_splits[j] != peer_sig.output_splits[r]:
                return MismatchReason.SPLIT_SIZES, SplitDisagreement(
                    sender=rank,
                    receiver=peer,
                    sends=sig.input_splits[j],
                    expects=peer_sig.output_splits[r],
                )
    return None, None


def analyze(
    run: RunT, events: Iterable[StoredEvent], *, until: float | None = None
) -> RunAnalysis[RunT]:
    """Fold every rank, in one pass over the events, and combine the folds.

    `until` keeps only events written at or before that wall time.
    """
    folds: dict[int, RankFold] = {}
    count = 0
    for stored in events:
        if until is not None and stored.wall_time > until:
            continue
        count += 1
        fold = folds.get(stored.rank)
        if fold is None:
            fold = folds[stored.rank] = RankFold(run_id=run.run_id, rank=stored.rank)
        fold.apply(stored)
    return combine(run, {rank: fold.view() for rank, fold in folds.items()})


def combine(run: RunT, views: Mapping[int, RankView]) -> RunAnalysis[RunT]:
    """The evidence across ranks, from each rank's view alone: whether the views come from
    every event or from a summary and the events after it, the analysis is the same."""
    views = dict(sorted(views.items()))
    members: dict[str, tuple[int, ...]] = {}
    for each in views.values():
        for progress in each.groups:
            if progress.ranks and progress.group not in members:
                members[progress.group] = progress.ranks
    groups: dict[str, GroupEvidence] = {}
    view: RankView | None
    for name, ranks in sorted(members.items()):
        started, finished = [], []
        recent: list[tuple[int, int, float]] = []
        for rank in ranks:
            view = views.get(rank)
            mine = next((g for g in view.groups if g.group == name), None) if view else None
            started.append((rank, mine.started if mine else -1))
            finished.append((rank, mine.finished if mine else -1))
            starts = dict(view.recent_starts).get(name, ()) if view else ()
            recent.extend((rank, start.seq, start.at) for start in starts)
        groups[name] = GroupEvidence(
            group=name,
            members=ranks,
            started=tuple(started),
            finished=tuple(finished),
            recent_starts=tuple(recent),
        )
    end_wall = max(
        [run.created_at, *(v.last_wall for v in views.values() if v.last_wall is not None)]
    )
    return RunAnalysis(
        run=run,
        views=views,
        groups=groups,
        mismatches=tuple(_mismatches(views, members)),
        last_progress={r: v.last_progress for r, v in views.items() if v.last_progress is not None},
        end_wall=end_wall,
        missing_ranks=tuple(r for r in range(run.world_size) if r not in views),
        events=sum(v.events for v in views.values()),
        recent_heartbeats={r: v.recent_heartbeats for r, v in views.items() if v.recent_heartbeats},
        shutdown_walls={
            r: v.shutdown_wall for r, v in views.items() if v.shutdown_wall is not None
        },
    )
