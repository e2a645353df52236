"""One pass over a run's events: each rank's fold, and the collective evidence across ranks."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from lifecycle.core.events import CollectiveStarted, Heartbeat, Shutdown, StoredEvent
from lifecycle.core.fold import RankFold, RankView
from replay.load import RunInfo

# How many of each member's latest collectives per group keep their start time: enough to
# tell, at the end of a run, which member came late to the collective another gave up on.
RECENT_STARTS = 8
# Each rank's last few heartbeats: a rank that wrote nothing while a peer wrote several was dead.
RECENT_HEARTBEATS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """What must match across the members of a collective at one sequence number."""

    op: str
    purpose: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    input_splits: tuple[int, ...] | None
    output_splits: tuple[int, ...] | None


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
class RunAnalysis:
    run: RunInfo
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


@dataclass
class _Book:
    """Collective signatures per (group, seq) until every member has reported one."""

    members: dict[str, tuple[int, ...]] = field(default_factory=dict)
    open: dict[tuple[str, int], dict[int, Signature]] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    recent: dict[tuple[str, int], deque[tuple[int, float]]] = field(default_factory=dict)
    interned: dict[Signature, Signature] = field(default_factory=dict)

    def add(self, rank: int, event: CollectiveStarted, wall: float) -> None:
        self.members.setdefault(event.group, event.group_ranks)
        starts = self.recent.get((event.group, rank))
        if starts is None:
            starts = self.recent[(event.group, rank)] = deque(maxlen=RECENT_STARTS)
        starts.append((event.group_seq, wall))
        key = (event.group, event.group_seq)
        signatures = self.open.setdefault(key, {})
        signature = Signature(
            op=event.op,
            purpose=event.purpose,
            dtype=event.dtype,
            shapes=event.shapes,
            input_splits=event.input_splits,
            output_splits=event.output_splits,
        )
        # Members of a healthy collective share one signature object.
        signatures[rank] = self.interned.setdefault(signature, signature)
        if len(signatures) == len(self.members[event.group]):
            self._check(key, self.members[event.group])
            del self.open[key]

    def finish(self) -> None:
        for key in list(self.open):
            if len(self.open[key]) > 1:
                self._check(key, self.members[key[0]])
        self.open.clear()

    def _check(self, key: tuple[str, int], members: tuple[int, ...]) -> None:
        signatures = self.open[key]
        distinct = {(s.op, s.purpose, s.dtype, s.shapes) for s in signatures.values()}
        reason: MismatchReason | None = None
        split = None
        if len(distinct) > 1:
            ops = {s.op for s in signatures.values()}
            reason = MismatchReason.OPS if len(ops) > 1 else MismatchReason.TYPES_OR_SHAPES
        else:
            reason, split = _split_mismatch(signatures, members)
        if reason is not None:
            self.mismatches.append(
                Mismatch(
                    group=key[0],
                    group_seq=key[1],
                    by_rank=tuple(sorted(signatures.items())),
                    reason=reason,
                    split=split,
                )
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
    run: RunInfo, events: Iterable[StoredEvent], *, until: float | None = None
) -> RunAnalysis:
    """Fold every rank and collect the collective evidence, in one pass over the events.

    `until` keeps only events written at or before that wall time.
    """
    folds: dict[int, RankFold] = {}
    book = _Book()
    last_progress: dict[int, float] = {}
    heartbeats: dict[int, deque[float]] = {}
    shutdowns: dict[int, float] = {}
    end_wall = run.created_at
    count = 0
    for stored in events:
        if until is not None and stored.wall_time > until:
            continue
        count += 1
        fold = folds.get(stored.rank)
        if fold is None:
            fold = folds[stored.rank] = RankFold(run_id=run.run_id, rank=stored.rank)
        fold.apply(stored)
        end_wall = max(end_wall, stored.wall_time)
        event = stored.event
        if isinstance(event, Heartbeat):
            beats = heartbeats.get(stored.rank)
            if beats is None:
                beats = heartbeats[stored.rank] = deque(maxlen=RECENT_HEARTBEATS)
            beats.append(stored.wall_time)
        elif isinstance(event, Shutdown):
            # Being told to stop is not progress: a rank stopped while stuck stays stuck.
            shutdowns.setdefault(stored.rank, stored.wall_time)
        else:
            last_progress[stored.rank] = stored.wall_time
        if isinstance(event, CollectiveStarted):
            book.add(stored.rank, event, stored.wall_time)
    book.finish()
    views = {rank: fold.view() for rank, fold in sorted(folds.items())}
    groups: dict[str, GroupEvidence] = {}
    for name, members in sorted(book.members.items()):
        started, finished = [], []
        for rank in members:
            progress = {g.group: g for g in views[rank].groups} if rank in views else {}
            mine = progress.get(name)
            started.append((rank, mine.started if mine else -1))
            finished.append((rank, mine.finished if mine else -1))
        recent = tuple(
            (rank, seq, wall) for rank in members for seq, wall in book.recent.get((name, rank), ())
        )
        groups[name] = GroupEvidence(
            group=name,
            members=members,
            started=tuple(started),
            finished=tuple(finished),
            recent_starts=recent,
        )
    missing = tuple(r for r in range(run.world_size) if r not in views)
    return RunAnalysis(
        run=run,
        views=views,
        groups=groups,
        mismatches=tuple(book.mismatches),
        last_progress=last_progress,
        end_wall=end_wall,
        missing_ranks=missing,
        events=count,
        recent_heartbeats={rank: tuple(beats) for rank, beats in heartbeats.items()},
        shutdown_walls=shutdowns,
    )
