"""A rank's collective groups as its fold tallies them, and the collective it waits in (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.format.events import CollectiveStarted
from lifecycle.core.format.records import GroupMark, PendingCollective
from lifecycle.core.format.view import OpenCollective


@dataclass(slots=True)
class GroupTally:
    """One group's progress as a rank's fold counts it: the highest sequence number it started
    and finished, and how many collectives it entered."""

    ranks: tuple[int, ...]
    started: int = -1
    finished: int = -1
    count: int = 0

    @classmethod
    def of(cls, mark: GroupMark) -> GroupTally:
        return cls(ranks=mark.ranks, started=mark.started, finished=mark.finished, count=mark.count)

    def mark(self, group: str) -> GroupMark:
        return GroupMark(
            group=group,
            ranks=self.ranks,
            started=self.started,
            finished=self.finished,
            count=self.count,
        )


def merge_marks(groups: dict[str, GroupTally], marks: tuple[GroupMark, ...]) -> None:
    """Progress a heartbeat or a finished request reports, for collectives whose records stay in
    the ring."""
    for mark in marks:
        group = groups.get(mark.group)
        if group is None:
            group = groups[mark.group] = GroupTally(ranks=mark.ranks)
        group.ranks = group.ranks or mark.ranks
        group.started = max(group.started, mark.started)
        group.finished = max(group.finished, mark.finished)
        group.count = max(group.count, mark.count)


def pending_collective(
    open_collectives: dict[str, OpenCollective],
    groups: dict[str, GroupTally],
    beat: PendingCollective | None,
    beat_wall: float | None,
) -> OpenCollective | None:
    """The collective a rank waits in: its latest open record, else what its last heartbeat
    (`beat`, written at `beat_wall`) says it waited in, when no record of it reached the
    journal."""
    opened = max(open_collectives.values(), key=lambda o: o.at) if open_collectives else None
    if beat is None or beat_wall is None:
        return opened
    group = groups.get(beat.group)
    recorded = open_collectives.get(beat.group)
    if (recorded is not None and recorded.started.group_seq >= beat.group_seq) or (
        group is not None and group.finished >= beat.group_seq
    ):
        return opened
    if opened is not None and opened.at >= beat_wall:
        return opened
    started = CollectiveStarted(
        group=beat.group,
        group_ranks=group.ranks if group is not None else (),
        group_seq=beat.group_seq,
        op=beat.op,
        purpose=beat.purpose,
        dtype="?",
        shapes=(),
        input_splits=None,
        output_splits=None,
        timeout_s=0.0,
    )
    return OpenCollective(started=started, at=beat_wall - beat.waiting_s, from_heartbeat=True)
