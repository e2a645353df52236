"""A rank's fold as a checkpoint: the summary its writer keeps, and a reader restores (pure).

A reader restores the fold from the checkpoint and applies only the events after it, so
`diagnose` and `runs` cost what the summaries hold, not what the journal holds. The format is
FOLD_VERSION: a reader that meets another version folds that rank from its first event
instead, so changing RankFold, or the version of an event kind it keeps, means a new version.
"""

from __future__ import annotations

import dataclasses
import typing
from collections import deque
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.codec import decode_payload, dumps_record, loads_record, to_payload
from lifecycle.core.format.events import Event
from lifecycle.core.format.fold import (
    NOTED_LISTS,
    RECENT_HEARTBEATS,
    RECENT_STARTS,
    RankFold,
    frozen,
    noted_list,
)
from lifecycle.core.format.groupfold import GroupTally
from lifecycle.core.format.records import GroupMark
from lifecycle.core.format.view import OpenCollective, RecentStart

# 2: the residency planner's events are noted; 3: Flight Recorder dumps; 4: agreed aborts;
# 5: residency_verified version 2 (times); 6: run_started version 2 (the launch phase), and
# the expectations a rank journals from history; 7: run_started version 3 (the phases before
# the journal), each finished action's time and each component load; 8: the compile's events;
# 9: gate-check's check of the ranks, and each request's lag
FOLD_VERSION = 9


@dataclass(frozen=True, slots=True, kw_only=True)
class NotedEvent:
    """An event a fold keeps with when, and in which state, it was written."""

    at: float
    state: str
    kind: str
    version: int
    data: Any  # the payload, a JSON object as the journal holds it

    @classmethod
    def of(cls, at: float, state: str, event: Event) -> NotedEvent:
        return cls(
            at=at, state=state, kind=event.kind, version=event.version, data=to_payload(event)
        )

    def restore(self) -> tuple[float, str, Event]:
        return self.at, self.state, decode_payload(self.kind, self.version, self.data)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupStarts:
    group: str
    starts: tuple[RecentStart, ...]


# RankFold's fields converted to types the journal's codec reads back; a dict is kept as a
# tuple of records that name their key.
_CONVERTED: dict[str, Any] = {
    "groups": tuple[GroupMark, ...],
    "open_collectives": tuple[OpenCollective, ...],
    "recent_starts": tuple[GroupStarts, ...],
}


def _as_record(hint: Any) -> Any:
    """list[T] and deque[T] as tuple[T, ...]; any other type as it is."""
    if typing.get_origin(hint) in (list, deque):
        return tuple[typing.get_args(hint)[0], ...]  # type: ignore[misc]
    return hint


def _checkpoint_fields() -> list[tuple[str, Any]]:
    noted = {name for _, name in NOTED_LISTS}
    hints = typing.get_type_hints(RankFold)
    kept = [
        (f.name, _CONVERTED.get(f.name, _as_record(hints[f.name])))
        for f in dataclasses.fields(RankFold)
        if f.name not in noted
    ]
    return [*kept, ("noted", tuple[NotedEvent, ...])]


# RankFold's fields, in types the journal's codec reads back (the noted events in one list, in
# order: errors, faults, stalls, buffer records, dumps).
FoldCheckpoint = dataclasses.make_dataclass(
    "FoldCheckpoint", _checkpoint_fields(), frozen=True, slots=True, kw_only=True
)


def _noted(fold: RankFold) -> tuple[NotedEvent, ...]:
    return tuple(
        NotedEvent.of(at, state, event)
        for _, name in NOTED_LISTS
        for at, state, event in getattr(fold, name)
    )


# RankFold's fields a checkpoint holds as they are (lists as tuples); the others are the noted
# events, the groups, the open collectives and the recent starts, converted below.
_AS_IS = tuple(
    f.name
    for f in dataclasses.fields(FoldCheckpoint)
    if f.name != "noted" and f.name not in _CONVERTED
)
_LISTS = frozenset(
    name
    for name, hint in typing.get_type_hints(RankFold).items()
    if name in _AS_IS and typing.get_origin(hint) is list
)


def checkpoint(fold: RankFold) -> str:
    """The fold as JSON text."""
    plain = {name: frozen(getattr(fold, name)) for name in _AS_IS}
    return dumps_record(
        FoldCheckpoint(
            **plain,
            noted=_noted(fold),
            groups=tuple(g.mark(name) for name, g in fold.groups.items()),
            open_collectives=tuple(fold.open_collectives.values()),
            recent_starts=tuple(
                GroupStarts(group=name, starts=tuple(starts))
                for name, starts in fold.recent_starts.items()
            ),
        )
    )


def restore(text: str) -> RankFold:
    """The fold a checkpoint holds; CorruptEvent when it does not read."""
    c: Any = loads_record(FoldCheckpoint, text)
    fold = RankFold(run_id=c.run_id, rank=c.rank)
    for name in _AS_IS:
        value = getattr(c, name)
        setattr(fold, name, list(value) if name in _LISTS else value)
    fold.recent_heartbeats = deque(c.recent_heartbeats, maxlen=RECENT_HEARTBEATS)
    for at, state, event in (noted.restore() for noted in c.noted):
        kept_in = noted_list(type(event))
        if kept_in is not None:
            getattr(fold, kept_in).append((at, state, event))
    fold.groups = {g.group: GroupTally.of(g) for g in c.groups}
    fold.open_collectives = {o.started.group: o for o in c.open_collectives}
    fold.recent_starts = {g.group: deque(g.starts, maxlen=RECENT_STARTS) for g in c.recent_starts}
    return fold
