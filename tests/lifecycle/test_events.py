"""Event kinds, their JSON codec, and upcasting of old payloads."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core import events as ev
from lifecycle.core.errors import CorruptEvent
from lifecycle.core.events import (
    EVENT_TYPES,
    Event,
    Heartbeat,
    PendingCollective,
    Transition,
    UnknownEvent,
    decode,
    decode_or_unknown,
    encode,
)
from tests.strategies import events

DESIGN_KINDS = {
    "run_started", "gate_decided", "plan_built", "transition", "action_started",
    "action_finished", "warmup_record", "collective_started", "collective_finished",
    "buffers_dropped", "buffers_allocated", "heartbeat", "stalled", "error", "fault_injected",
    "request_started", "request_finished", "shutdown",
}  # fmt: skip


def test_every_designed_kind_has_an_event_class() -> None:
    """The journal knows exactly the event kinds of DESIGN.md section 6."""
    assert set(EVENT_TYPES) == DESIGN_KINDS


def test_events_are_frozen() -> None:
    """An event cannot be changed after it is made."""
    event = Transition(trigger="start", source="created", dest="gate-check")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.trigger = "warm"  # type: ignore[misc]


@given(event=events())
def test_encode_then_decode_is_identity(event: Event) -> None:
    """Every event survives its JSON payload unchanged, and the payload is a JSON object."""
    text = encode(event)
    assert isinstance(json.loads(text), dict)
    assert decode(event.kind, event.version, text) == event


def test_nested_records_decode_to_their_types() -> None:
    """Nested records come back as their dataclasses, not as dicts."""
    beat = Heartbeat(
        uptime_s=1.5,
        in_state_s=0.5,
        pending=PendingCollective(
            group="ulysses0", group_seq=7, op="all_to_all", purpose="ulysses-qkv", waiting_s=2.0
        ),
    )
    back = decode("heartbeat", 1, encode(beat))
    assert isinstance(back, Heartbeat)
    assert isinstance(back.pending, PendingCollective)
    assert back.pending.group_seq == 7


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON list, not an object"),
        ('{"trigger": "start", "source": "created"}', "missing field 'dest'"),
        ('{"trigger": 3, "source": "created", "dest": "x"}', "expected a string"),
    ],
)
def test_malformed_payloads_are_refused_with_a_reason(text: str, reason: str) -> None:
    """A payload that is not a JSON object of the right fields raises CorruptEvent."""
    with pytest.raises(CorruptEvent, match=reason):
        decode("transition", 1, text)
    unknown = decode_or_unknown("transition", 1, text)
    assert isinstance(unknown, UnknownEvent)
    assert reason in unknown.reason


def test_unknown_kinds_are_kept_not_fatal() -> None:
    """A kind this lifecycle does not know decodes to UnknownEvent with its raw payload."""
    event = decode("future_kind", 3, '{"x": 1}')
    assert isinstance(event, UnknownEvent)
    assert (event.row_kind, event.row_version, event.raw) == ("future_kind", 3, '{"x": 1}')


def test_a_newer_payload_version_is_refused() -> None:
    """A payload written by a newer event version is not guessed at."""
    with pytest.raises(CorruptEvent, match="newer"):
        decode("transition", 2, encode(Transition(trigger="a", source="b", dest="c")))


@given(text=st.text(max_size=200))
def test_decoder_never_raises_anything_but_corrupt_event(text: str) -> None:
    """Arbitrary text as a payload yields an event or CorruptEvent, nothing else."""
    for kind in EVENT_TYPES:
        with contextlib.suppress(CorruptEvent):
            decode(kind, 1, text)


@given(payload=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
))  # fmt: skip
def test_decoder_survives_any_json_value(payload: object) -> None:
    """Any JSON value, for any kind, decodes or is refused as CorruptEvent."""
    text = json.dumps(payload)
    for kind in EVENT_TYPES:
        with contextlib.suppress(CorruptEvent):
            decode(kind, 1, text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Renamed(Event):
    """A test-only kind at version 2: v1 called `elapsed` what v2 calls `duration_s`."""

    kind: ClassVar[str] = "test_renamed"
    version: ClassVar[int] = 2
    duration_s: float
    unit: str


def test_old_payloads_are_upcast_on_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A v1 payload passes through the registered upcaster and decodes as v2."""

    def upcast_v1_to_v2(payload: dict[str, object]) -> dict[str, object]:
        return {"duration_s": payload["elapsed"], "unit": "s"}

    monkeypatch.setitem(ev.EVENT_TYPES, Renamed.kind, Renamed)
    monkeypatch.setitem(ev.UPCASTERS, (Renamed.kind, 1), upcast_v1_to_v2)
    assert decode("test_renamed", 1, '{"elapsed": 2.5}') == Renamed(duration_s=2.5, unit="s")
    assert decode("test_renamed", 2, encode(Renamed(duration_s=1.0, unit="s"))) == Renamed(
        duration_s=1.0, unit="s"
    )


def test_a_missing_upcaster_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """An old version without an upcaster is refused, not decoded as if current."""
    monkeypatch.setitem(ev.EVENT_TYPES, Renamed.kind, Renamed)
    with pytest.raises(CorruptEvent, match="no upcaster from version 1"):
        decode("test_renamed", 1, '{"elapsed": 2.5}')


def test_nan_cannot_be_encoded() -> None:
    """NaN is not JSON; encoding it is refused rather than written."""
    with pytest.raises(CorruptEvent, match="cannot encode"):
        encode(Heartbeat(uptime_s=float("nan"), in_state_s=0.0, pending=None))
