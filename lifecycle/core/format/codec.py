"""The journal's payload codec: events to JSON objects and back, old versions upcast on read."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from lifecycle.core.errors import CorruptEvent
from lifecycle.core.format.events import EVENT_TYPES, Event, UnknownEvent
from lifecycle.core.format.upcasters import (
    upcast_error_v1_to_v2,
    upcast_heartbeat_v1_to_v2,
    upcast_plan_built_v1_to_v2,
    upcast_request_finished_v1_to_v2,
    upcast_request_started_v1_to_v2,
    upcast_request_started_v2_to_v3,
    upcast_residency_planned_v1_to_v2,
    upcast_residency_verified_v1_to_v2,
    upcast_run_started_v1_to_v2,
    upcast_run_started_v2_to_v3,
    upcast_warmup_record_v1_to_v2,
)

# The reason an UnknownEvent gives for a row whose kind this lifecycle does not know.
UNKNOWN_KIND = "unknown kind"

# (kind, version) -> function turning a payload of that version into the next version's payload.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
UPCASTERS: dict[tuple[str, int], Upcaster] = {
    ("error", 1): upcast_error_v1_to_v2,
    ("plan_built", 1): upcast_plan_built_v1_to_v2,
    ("warmup_record", 1): upcast_warmup_record_v1_to_v2,
    ("request_started", 1): upcast_request_started_v1_to_v2,
    ("request_started", 2): upcast_request_started_v2_to_v3,
    ("heartbeat", 1): upcast_heartbeat_v1_to_v2,
    ("request_finished", 1): upcast_request_finished_v1_to_v2,
    ("residency_verified", 1): upcast_residency_verified_v1_to_v2,
    ("residency_planned", 1): upcast_residency_planned_v1_to_v2,
    ("run_started", 1): upcast_run_started_v1_to_v2,
    ("run_started", 2): upcast_run_started_v2_to_v3,
}


def encode(event: Event) -> str:
    """The event's payload as compact JSON text (a JSON object)."""
    try:
        return _DUMPS(_plain_for(type(event))(event))
    except ValueError as exc:
        raise CorruptEvent(kind=event.kind, reason=f"cannot encode: {exc}") from exc


_DUMPS = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def dumps_record(value: Any) -> str:
    """Any of the journal's records (a dataclass of JSON values) as compact JSON text."""
    return _DUMPS(_plain_for(type(value))(value))


def loads_record(cls: type[T], text: str) -> T:
    """The record of type `cls` that `dumps_record` wrote; CorruptEvent names what is wrong."""
    try:
        payload = json.loads(text)
        return typing.cast(T, _converter_for(cls)(payload))
    except (ValueError, TypeError, RecursionError, _Invalid) as exc:
        raise CorruptEvent(kind=cls.__name__, reason=str(exc)) from None


Plain = Callable[[Any], Any]
T = typing.TypeVar("T")
_PLAIN: dict[type, Plain] = {}


def _plain_for(cls: type) -> Plain:
    """A dataclass to a dict of JSON values, copying only what nests (unlike asdict, which
    deep-copies every tuple of every record). A StrEnum is a str, so it is written as its
    value without a copy."""
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
    if kind not in EVENT_TYPES:
        return UnknownEvent(row_kind=kind, row_version=version, reason=UNKNOWN_KIND, raw=text)
    try:
        payload = json.loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CorruptEvent(kind=kind, reason=f"data is not JSON ({exc})") from exc
    return decode_payload(kind, version, payload)


def decode_payload(kind: str, version: int, payload: Any) -> Event:
    """Decode a payload already read from JSON (see decode)."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raw = _DUMPS(payload) if isinstance(payload, dict) else str(payload)
        return UnknownEvent(row_kind=kind, row_version=version, reason=UNKNOWN_KIND, raw=raw)
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


def to_payload(event: Event) -> dict[str, Any]:
    """The event's payload as JSON values (what `encode` writes as text)."""
    return typing.cast(dict[str, Any], _plain_for(type(event))(event))


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
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        return _str_enum(tp)
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
    # their converters. Floats are not: a JSON number may overflow to infinity, which the
    # encoder refuses, so each is checked to be finite.
    fields = [
        (
            f.name,
            hints[f.name] if hints[f.name] in (str, int, bool) else None,
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
            try:
                out = tuple(map(float, v))
            except OverflowError:
                raise _Invalid("expected a list of finite numbers") from None
            if not all(map(math.isfinite, out)):
                raise _Invalid("expected a list of finite numbers")
            return out

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
    try:
        out = float(v)
    except OverflowError:
        raise _Invalid("expected a finite number") from None
    if not math.isfinite(out):
        raise _Invalid("expected a finite number")
    return out


def _str_enum(cls: type[enum.StrEnum]) -> Converter:
    """A StrEnum field: one of the enum's values, else the payload is refused."""
    members = {member.value: member for member in cls}
    allowed = ", ".join(sorted(members))

    def convert(v: Any) -> Any:
        member = members.get(v) if isinstance(v, str) else None
        if member is None:
            raise _Invalid(f"expected one of {allowed}, got {_describe(v)}")
        return member

    return convert


def _describe(v: Any) -> str:
    return repr(v)[:40] if isinstance(v, str) else type(v).__name__


def _json_value(v: Any) -> Any:
    return v
