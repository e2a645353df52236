"""Event kinds as frozen dataclasses, their JSON codec, and the upcasters of old payloads."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from lifecycle.core.errors import CorruptEvent

# ---------------------------------------------------------------------------------------------
# Nested records (part of the journal format: change them only with a version bump + upcaster)


@dataclass(frozen=True, slots=True, kw_only=True)
class GateRecord:
    name: str
    passed: bool
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PlatformRecord:
    device: str
    name: str
    total_bytes: int
    free_bytes: int
    peak_source: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRequest:
    role: str
    width: int
    height: int
    frames: int
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeFitRecord:
    default_width: int
    default_height: int
    default_frames: int
    fitted_width: int | None
    fitted_height: int | None
    fitted_frames: int | None
    estimated_peak_bytes: int
    budget_bytes: int
    free_bytes: int
    reserve_bytes: int
    frame_shrinks: int
    area_shrinks: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRecord:
    name: str  # text_encoder, dit, vae
    ran: bool
    seconds: float
    peak_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingCollective:
    group: str
    group_seq: int
    op: str
    purpose: str
    waiting_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadStack:
    name: str
    ident: int
    stack: str


# ---------------------------------------------------------------------------------------------
# Event kinds


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Base of the event kinds; `kind` names it in the journal, `version` is its payload schema."""

    kind: ClassVar[str] = ""
    version: ClassVar[int] = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    world_size: int
    host: str
    pid: int
    lifecycle_version: str
    torch_version: str | None
    python_version: str
    device: str
    dist_backend: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class GateDecided(Event):
    kind: ClassVar[str] = "gate_decided"
    skip_reason: str | None
    local_skip_reason: str | None  # this rank's own decision before the ranks agreed
    gates: tuple[GateRecord, ...]
    platform: PlatformRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanBuilt(Event):
    kind: ClassVar[str] = "plan_built"
    skip_reason: str | None
    requests: tuple[PlannedRequest, ...]
    probe_fit: ProbeFitRecord | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition(Event):
    kind: ClassVar[str] = "transition"
    trigger: str
    source: str
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionStarted(Event):
    kind: ClassVar[str] = "action_started"
    action: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionFinished(Event):
    kind: ClassVar[str] = "action_finished"
    action: str
    duration_s: float
    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupRecord(Event):
    kind: ClassVar[str] = "warmup_record"
    role: str
    width: int
    height: int
    frames: int
    steps: int
    tokens: int
    total_s: float
    step_s: tuple[float, ...]
    stages: tuple[StageRecord, ...]
    memory_source: str | None
    baseline_bytes: int | None
    peak_bytes: int | None
    checksum: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveStarted(Event):
    kind: ClassVar[str] = "collective_started"
    group: str
    group_ranks: tuple[int, ...]
    group_seq: int
    op: str
    purpose: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    input_splits: tuple[int, ...] | None
    output_splits: tuple[int, ...] | None
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFinished(Event):
    kind: ClassVar[str] = "collective_finished"
    group: str
    group_seq: int
    op: str
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BuffersAllocated(Event):
    kind: ClassVar[str] = "buffers_allocated"
    purpose: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    live_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BuffersDropped(Event):
    kind: ClassVar[str] = "buffers_dropped"
    buffers: int
    bytes_freed: int
    keys: tuple[str, ...]
    allocator_released_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Event):
    kind: ClassVar[str] = "heartbeat"
    uptime_s: float
    in_state_s: float
    pending: PendingCollective | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stalled(Event):
    kind: ClassVar[str] = "stalled"
    in_state_s: float
    deadline_s: float
    pending: PendingCollective | None
    threads: tuple[ThreadStack, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Event):
    kind: ClassVar[str] = "error"
    error_type: str
    message: str
    traceback: str
    trigger: str | None
    fatal: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    fault: str
    fault_kind: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestStarted(Event):
    kind: ClassVar[str] = "request_started"
    request_id: str
    source: str  # "http" or "smoke"
    width: int
    height: int
    frames: int
    steps: int
    prompt_chars: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    kind: ClassVar[str] = "request_finished"
    request_id: str
    ok: bool
    total_s: float
    checksum: str | None
    peak_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Event):
    kind: ClassVar[str] = "shutdown"
    reason: str
    signal: str | None
    events_written: int  # this rank's events before this one
    journal_write_s: float  # time this rank spent committing them


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(Event):
    """A row whose kind this lifecycle does not know, or whose payload does not decode."""

    kind: ClassVar[str] = "unknown"
    row_kind: str
    row_version: int
    reason: str
    raw: str


UNKNOWN_KIND = "unknown kind"

EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted,
        GateDecided,
        PlanBuilt,
        Transition,
        ActionStarted,
        ActionFinished,
        WarmupRecord,
        CollectiveStarted,
        CollectiveFinished,
        BuffersAllocated,
        BuffersDropped,
        Heartbeat,
        Stalled,
        Error,
        FaultInjected,
        RequestStarted,
        RequestFinished,
        Shutdown,
    )
}

# (kind, version) -> function turning a payload of that version into the next version's payload.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


# ---------------------------------------------------------------------------------------------
# Codec


def encode(event: Event) -> str:
    """The event's payload as compact JSON text (a JSON object)."""
    try:
        return _DUMPS(_plain_for(type(event))(event))
    except ValueError as exc:
        raise CorruptEvent(kind=event.kind, reason=f"cannot encode: {exc}") from exc


_DUMPS = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
Plain = Callable[[Any], Any]
_PLAIN: dict[type, Plain] = {}


def _plain_for(cls: type) -> Plain:
    """A dataclass to a dict of JSON values, copying only what nests (unlike asdict, which
    deep-copies every tuple of every record)."""
    plain = _PLAIN.get(cls)
    if plain is not None:
        return plain
    hints = typing.get_type_hints(cls)
    nested = []
    for f in dataclasses.fields(cls):
        inner = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if t is not type(None)]
        if any(dataclasses.is_dataclass(t) for t in inner):
            nested.append(f.name)
    names = [f.name for f in dataclasses.fields(cls)]

    def to_plain(value: Any) -> Any:
        out = {name: getattr(value, name) for name in names}
        for name in nested:
            item = out[name]
            if isinstance(item, tuple):
                out[name] = [_plain_for(type(x))(x) for x in item]
            elif item is not None:
                out[name] = _plain_for(type(item))(item)
        return out

    _PLAIN[cls] = to_plain
    return to_plain


def decode(kind: str, version: int, text: str) -> Event:
    """Decode one stored payload into its event, upcasting old versions.

    Unknown kinds come back as UnknownEvent; a malformed payload raises CorruptEvent.
    """
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        return UnknownEvent(row_kind=kind, row_version=version, reason=UNKNOWN_KIND, raw=text)
    try:
        payload = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptEvent(kind=kind, reason=f"data is not JSON ({exc})") from exc
    if not isinstance(payload, dict):
        raise CorruptEvent(
            kind=kind, reason=f"data is a JSON {type(payload).__name__}, not an object"
        )
    if version > cls.version:
        raise CorruptEvent(
            kind=kind,
            reason=f"payload version {version} is newer than this lifecycle's {cls.version}",
        )
    while version < cls.version:
        upcast = UPCASTERS.get((kind, version))
        if upcast is None:
            raise CorruptEvent(kind=kind, reason=f"no upcaster from version {version}")
        payload = upcast(payload)
        version += 1
    try:
        return typing.cast(Event, _converter_for(cls)(payload))
    except _Invalid as exc:
        raise CorruptEvent(kind=kind, reason=str(exc)) from None


def decode_or_unknown(kind: str, version: int, text: str) -> Event:
    """Like decode, but a corrupt payload becomes an UnknownEvent that says why."""
    try:
        return decode(kind, version, text)
    except CorruptEvent as exc:
        return UnknownEvent(row_kind=kind, row_version=version, reason=exc.reason, raw=text)


class _Invalid(Exception):
    pass


Converter = Callable[[Any], Any]
_CONVERTERS: dict[Any, Converter] = {}


def _converter_for(tp: Any) -> Converter:
    conv = _CONVERTERS.get(tp)
    if conv is None:
        conv = _build_converter(tp)
        _CONVERTERS[tp] = conv
    return conv


def _build_converter(tp: Any) -> Converter:
    if tp is Any:
        return _json_value
    if tp is bool:
        return _check(lambda v: isinstance(v, bool), "a boolean")
    if tp is int:
        return _check(lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    if tp is str:
        return _check(lambda v: isinstance(v, str), "a string")
    if tp is float:
        return _to_float
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported union {tp!r}")
        inner_conv = _converter_for(inner[0])
        return lambda v: None if v is None else inner_conv(v)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis and args[0] in _PRIMITIVE_ITEMS:
            return _primitive_tuple(args[0])
        if len(args) == 2 and args[1] is Ellipsis:
            item = _converter_for(args[0])

            def to_tuple(v: Any) -> tuple[Any, ...]:
                if not isinstance(v, list | tuple):
                    raise _Invalid(f"expected a list, got {type(v).__name__}")
                return tuple(item(x) for x in v)

            return to_tuple
        raise TypeError(f"unsupported tuple type {tp!r}")
    if origin is dict:
        value_conv = _converter_for(args[1])

        def to_dict(v: Any) -> dict[str, Any]:
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise _Invalid("expected an object")
            return {k: value_conv(x) for k, x in v.items()}

        return to_dict
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _dataclass_converter(tp)
    raise TypeError(f"unsupported field type {tp!r}")


def _dataclass_converter(cls: type) -> Converter:
    hints = typing.get_type_hints(cls)
    # Scalar fields are checked inline (the hot path of a large journal); the rest go through
    # their converters.
    fields = [
        (
            f.name,
            hints[f.name] if hints[f.name] in (str, int, float, bool) else None,
            _converter_for(hints[f.name]),
            f.default is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    ]
    name_of = cls.__name__

    def to_instance(v: Any) -> Any:
        if type(v) is not dict:
            raise _Invalid(f"{name_of}: expected an object, got {type(v).__name__}")
        values: dict[str, Any] = {}
        for name, scalar, conv, required in fields:
            if name not in v:
                if required:
                    raise _Invalid(f"{name_of}: missing field {name!r}")
                continue
            x = v[name]
            if scalar is not None and type(x) is scalar:
                values[name] = x
                continue
            try:
                values[name] = conv(x)
            except _Invalid as exc:
                raise _Invalid(f"{name_of}.{name}: {exc}") from None
        return cls(**values)

    return to_instance


_PRIMITIVE_ITEMS = (int, float, str, bool)
_NUMBERS = frozenset({int, float})


def _primitive_tuple(item: type) -> Converter:
    """tuple[int, ...] and the like, checked in one pass: the bulk of collective records."""
    if item is float:

        def floats(v: Any) -> tuple[float, ...]:
            if not isinstance(v, list | tuple) or not set(map(type, v)) <= _NUMBERS:
                raise _Invalid("expected a list of numbers")
            return tuple(map(float, v))

        return floats

    allowed = frozenset({item})

    def items(v: Any) -> tuple[Any, ...]:
        # map(type, ...) in C: a bool is not an int here, as in the scalar check.
        if not isinstance(v, list | tuple) or not set(map(type, v)) <= allowed:
            raise _Invalid(f"expected a list of {item.__name__}")
        return tuple(v)

    return items


def _check(ok: Callable[[Any], bool], what: str) -> Converter:
    def convert(v: Any) -> Any:
        if not ok(v):
            raise _Invalid(f"expected {what}, got {type(v).__name__}")
        return v

    return convert


def _to_float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _Invalid(f"expected a number, got {type(v).__name__}")
    return float(v)


def _json_value(v: Any) -> Any:
    return v


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredEvent:
    """One journal row: the envelope (who, when, in which state) around a decoded event."""

    run_id: str
    rank: int
    seq: int
    wall_time: float
    mono_ns: int
    state: str  # the rank's state after this event
    event: Event

    @property
    def kind(self) -> str:
        event = self.event
        return event.row_kind if isinstance(event, UnknownEvent) else event.kind
