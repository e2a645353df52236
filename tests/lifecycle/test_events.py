"""Event kinds, their JSON codec, and upcasting of old payloads."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.errors import CorruptEvent, PeerGone
from lifecycle.core.format import codec
from lifecycle.core.format import events as ev
from lifecycle.core.format.codec import decode, decode_or_unknown, encode
from lifecycle.core.format.events import (
    EVENT_TYPES,
    Error,
    Event,
    Heartbeat,
    Transition,
    UnknownEvent,
    error_event,
)
from lifecycle.core.format.records import PendingCollective
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow
from tests.strategies import events
from tests.support import T0

DESIGN_KINDS = {
    "run_started", "gate_decided", "plan_built", "transition", "action_started",
    "action_finished", "warmup_record", "collective_started", "collective_finished",
    "buffers_dropped", "buffers_allocated", "heartbeat", "stalled", "error", "fault_injected",
    "request_started", "request_finished", "shutdown", "residency_planned", "residency_applied",
    "residency_verified", "residency_rolled_back", "aborted",
}  # fmt: skip
# Beyond the designed kinds: the marker before the collective records a rank's ring writes on
# trouble after ready (reason, records, dropped), so replay can say why and how many; each
# rank's clock offset to rank 0, measured at the rendezvous; and the deadlines each state was
# held to, learned from the journal's history at gate-check; and each pipeline component's
# load, before it reads and after (the startup accounted); and the compile, and the compiler's
# artifact kept, and the learned shapes chosen to warm (docs/compile.md); and the weights'
# path, kept, reference, rejected and released (docs/keeper.md); and gate-check's check of
# the ranks: environment, probe figures, slow (docs/ranks.md).
BEYOND_DESIGN_KINDS = {
    "collectives_dumped", "clock_aligned", "flight_recorder_dumped", "expectations",
    "load_started", "load_finished", "compiled", "compile_kept", "shapes_chosen",
    "weights_path", "weights_kept", "reference_output", "attach_rejected", "weights_released",
    "environment_checked", "rank_probed", "slow_rank",
}  # fmt: skip


def test_every_designed_kind_has_an_event_class() -> None:
    """The journal knows exactly the designed event kinds (docs/architecture.md), and the
    ones docs/reference/events.md lists beyond it."""
    assert set(EVENT_TYPES) == DESIGN_KINDS | BEYOND_DESIGN_KINDS


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


def assert_decodes_faithfully(kind: str, version: int, text: str) -> None:
    """`text` is refused as CorruptEvent, or decodes to the kind's class and that event
    survives its own payload unchanged."""
    try:
        event = decode(kind, version, text)
    except CorruptEvent:
        return
    assert type(event) is EVENT_TYPES[kind]
    assert decode(kind, event.version, encode(event)) == event


@given(text=st.text(max_size=200))
def test_decoder_never_raises_anything_but_corrupt_event(text: str) -> None:
    """Arbitrary text as a payload, at every kind's first and current version, is refused as
    CorruptEvent or decodes to an event of that kind that re-encodes to itself."""
    for kind, cls in EVENT_TYPES.items():
        for version in {1, cls.version}:
            assert_decodes_faithfully(kind, version, text)


@given(payload=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
))  # fmt: skip
def test_decoder_survives_any_json_value(payload: object) -> None:
    """Any JSON value, for any kind and version, is refused as CorruptEvent or decodes to an
    event of that kind that re-encodes to itself."""
    text = json.dumps(payload)
    for kind, cls in EVENT_TYPES.items():
        for version in {1, cls.version}:
            assert_decodes_faithfully(kind, version, text)


@given(event=events(), field_index=st.integers(min_value=0), value=st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from(["bounded", "probe", "rewarm"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["width", "height", "frames", "role", "shape", "steps", "name"]),
        inner, max_size=4),
    max_leaves=8,
))  # fmt: skip
def test_a_payload_with_one_field_replaced_decodes_faithfully_or_not_at_all(
    event: Event, field_index: int, value: object
) -> None:
    """A real payload with one field set to any JSON value is refused as CorruptEvent, or
    decodes to an event of its kind that re-encodes to itself."""
    payload = json.loads(encode(event))
    if payload:
        name = sorted(payload)[field_index % len(payload)]
        payload[name] = value
    assert_decodes_faithfully(event.kind, event.version, json.dumps(payload))


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
    monkeypatch.setitem(codec.UPCASTERS, (Renamed.kind, 1), upcast_v1_to_v2)
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


V1_ERRORS = [
    ("CollectiveTimeout", "all_to_all #3 in group ulysses0 did not finish within 600 s",
     "collective-timeout"),
    ("CollectiveError", "all_to_all #3 in group ulysses0 failed (ulysses-qkv): [pair.cc:534]"
     " Connection closed by peer [127.0.0.1]:29500", "peer-gone"),
    ("CollectiveError", "all_to_all #3 in group ulysses0 failed (ulysses-qkv): Read error"
     " [127.0.0.1]:29500: Connection reset by peer", "peer-gone"),
    ("CollectiveError", "all_reduce_max #0 in group world failed (gate-decision): bad op",
     "collective-failed"),
    ("InjectedFault", "fault injected on rank 1 in state 'probe'", "injected-fault"),
    ("IllegalTransition", "trigger 'warm' is not allowed in state 'ready': no edge",
     "illegal-transition"),
    ("StartupTimeout", "startup did not reach ready within 30 s", "startup-timeout"),
    ("OutOfMemoryError", "CUDA out of memory", "exception"),
]  # fmt: skip


@pytest.mark.parametrize(("error_type", "message", "kind"), V1_ERRORS)
def test_a_v1_error_row_in_a_journal_reads_with_its_kind(
    tmp_path: Path, error_type: str, message: str, kind: str
) -> None:
    """An `error` row stored at version 1, before `error_kind` existed, reads back from a real
    SQLite journal as version 2 with the kind its class name and message imply."""
    db = tmp_path / "j.db"
    journal = Journal.open_for_write(str(db))
    journal.create_run(
        RunRow(run_id="run-v1", created_at=T0, host="h", world_size=1, config={},
               lifecycle_version="0.1.0")
    )  # fmt: skip
    writer = journal.writer(run_id="run-v1", rank=0)
    writer.append(
        Transition(trigger="start", source="created", dest="gate-check"),
        state="gate-check", wall_time=T0 + 1, mono_ns=1,
    )  # fmt: skip
    writer.close()
    journal.close()
    v1 = {"error_type": error_type, "message": message, "traceback": "", "trigger": None,
          "fatal": True}  # fmt: skip
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state,"
            " data) VALUES ('run-v1', 0, 1, ?, 2, 'error', 1, 'gate-check', ?)",
            (T0 + 2, json.dumps(v1)),
        )
    reader = Journal.open_for_read(str(db))
    try:
        stored = list(reader.read(run_id="run-v1", rank=0))
    finally:
        reader.close()
    assert stored[-1].event == Error(
        error_type=error_type, error_kind=kind, message=message, traceback="", trigger=None,
        fatal=True,
    )  # fmt: skip


def test_the_v1_upcaster_keeps_a_payload_it_cannot_read_for_the_decoder_to_refuse() -> None:
    """A v1 error payload missing its fields is refused as CorruptEvent, not crashed on."""
    with pytest.raises(CorruptEvent, match="missing field 'error_type'"):
        decode("error", 1, '{"message": 3}')


def test_errors_are_written_at_version_2_with_their_kind() -> None:
    """An error recorded now carries the kind its exception declares, at payload version 2."""
    event = error_event(
        PeerGone("all_to_all #0 in group world failed", group="world", group_seq=0, op="a2a"),
        fatal=True, trigger=None, traceback="",
    )  # fmt: skip
    assert (event.version, event.error_kind, event.error_type) == (2, "peer-gone", "PeerGone")
    assert json.loads(encode(event))["error_kind"] == "peer-gone"
