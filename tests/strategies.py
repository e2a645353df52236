"""Hypothesis strategies for journal events, derived from the event dataclasses' type hints
(nested domain values such as Shape, and StrEnum fields, included)."""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Union

from hypothesis import strategies as st

from lifecycle.core.format.events import EVENT_TYPES, Event, StoredEvent
from lifecycle.core.format.states import State

_text = st.text(max_size=24)
_float = st.floats(allow_nan=False, allow_infinity=False, width=64)
_int = st.integers(min_value=-(2**53), max_value=2**53)


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    if tp is str:
        return _text
    if tp is int:
        return _int
    if tp is float:
        return _float
    if tp is bool:
        return st.booleans()
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        return st.sampled_from(tuple(tp))
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return st.none() | for_type(inner[0])
    if origin is tuple:
        return st.lists(for_type(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(_text, st.integers() | _text, max_size=3)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f.name: for_type(hints[f.name]) for f in dataclasses.fields(tp)})
    raise TypeError(tp)


def events() -> st.SearchStrategy[Event]:
    return st.one_of(*(for_type(cls) for cls in EVENT_TYPES.values()))


@st.composite
def rank_streams(draw: st.DrawFn, *, run_id: str = "run-a", ranks: int = 2) -> list[StoredEvent]:
    """Events of several ranks, each with gapless seqs and increasing times."""
    out: list[StoredEvent] = []
    for rank in range(ranks):
        wall = 1_800_000_000.0
        for seq, event in enumerate(draw(st.lists(events(), max_size=12))):
            wall += draw(st.floats(min_value=0.0, max_value=5.0))
            out.append(
                StoredEvent(
                    run_id=run_id,
                    rank=rank,
                    seq=seq,
                    wall_time=wall,
                    mono_ns=seq * 1000,
                    state=draw(st.sampled_from([s.value for s in State])),
                    event=event,
                )
            )
    return out
