"""The control channel's messages under torchrun as they travel: each rank's up through the
rendezvous store (one key per message in order, and a beat counter), rank 0's down over the
control group. JSON text, sealed with the run's store key by whoever sends it and opened by
whoever reads it (lifecycle.runtime.group.storetrust), never unpickled."""

from __future__ import annotations

import json
from typing import Any

from lifecycle.core.errors import CorruptEvent
from lifecycle.core.format.codec import decode_or_unknown, dumps_record, encode, loads_record
from lifecycle.core.format.events import StoredEvent
from lifecycle.serve.ranks import messages as msg
from lifecycle.serve.ranks.messages import FromRank, ToRank

Up = FromRank | StoredEvent
# The channels each message is sealed for (with its slot's rank and sequence number).
UP, BEAT, DOWN = "up", "beat", "down"


def _prefix(run_id: str, rank: int) -> str:
    return f"lifecycle/{run_id}/serve/{rank}"


def message_key(run_id: str, rank: int, seq: int) -> str:
    return f"{_prefix(run_id, rank)}/up/{seq}"


def beat_key(run_id: str, rank: int) -> str:
    return f"{_prefix(run_id, rank)}/beat"


# -- up: a rank's replies and events ------------------------------------------------------------

_MESSAGES: dict[str, type[FromRank]] = {
    "hello": msg.Hello,
    "ready": msg.Ready,
    "progress": msg.Progress,
    "result": msg.Result,
    "rejected": msg.Rejected,
    "cancel_point": msg.CancelPoint,
}
_NAMES = {cls: name for name, cls in _MESSAGES.items()}


def to_wire(item: Up) -> bytes:
    if isinstance(item, StoredEvent):
        event = item.event
        doc: dict[str, Any] = {
            "type": "event",
            "seq": item.seq,
            "wall": item.wall_time,
            "mono_ns": item.mono_ns,
            "state": item.state,
            "kind": event.kind,
            "version": event.version,
            "payload": encode(event),
        }
        return json.dumps(doc).encode()
    return json.dumps({"type": _NAMES[type(item)], "message": dumps_record(item)}).encode()


def from_wire(data: bytes, *, run_id: str, rank: int) -> Up | None:
    """The message `data` holds from `rank`; None for anything else, or a message that names
    another rank."""
    try:
        doc = json.loads(data)
        kind = doc["type"]
        if kind == "event":
            return StoredEvent(
                run_id=run_id,
                rank=rank,
                seq=int(doc["seq"]),
                wall_time=float(doc["wall"]),
                mono_ns=int(doc["mono_ns"]),
                state=str(doc["state"]),
                event=decode_or_unknown(str(doc["kind"]), int(doc["version"]), doc["payload"]),
            )
        message = loads_record(_MESSAGES[kind], doc["message"])
    except (ValueError, KeyError, TypeError, RecursionError, CorruptEvent):
        return None
    return message if message.rank == rank else None


def beat_from_wire(data: bytes) -> int | None:
    """The count a beat holds; None for anything else."""
    text = data.decode("ascii", "replace")
    return int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None


# -- down: rank 0's orders, each with the ranks it is for ----------------------------------------

_Order = msg.Generate | msg.Stop | msg.Dump | msg.GivenUp | msg.Cancel | msg.CancelAt | msg.Rest
_ORDERS: dict[str, type[_Order]] = {
    "generate": msg.Generate,
    "stop": msg.Stop,
    "dump": msg.Dump,
    "given_up": msg.GivenUp,
    "cancel": msg.Cancel,
    "cancel_at": msg.CancelAt,
    "rest": msg.Rest,
}
_ORDER_NAMES: dict[type, str] = {cls: name for name, cls in _ORDERS.items()}


def order_to_wire(targets: frozenset[int], message: ToRank | None) -> bytes:
    """A broadcast: `message` for `targets`, or a keep-alive (None). (A `Lost` is put by a
    rank's own bridge, never sent: it has no name here.)"""
    doc: dict[str, Any] = {"targets": sorted(targets), "type": None, "message": None}
    if message is not None:
        doc.update(type=_ORDER_NAMES[type(message)], message=dumps_record(message))
    return json.dumps(doc).encode()


def order_from_wire(data: bytes) -> tuple[frozenset[int], ToRank | None] | None:
    """The targets and message (None: a keep-alive) a broadcast holds; None for anything
    else."""
    try:
        doc = json.loads(data)
        targets = frozenset(int(rank) for rank in doc["targets"])
        kind = doc["type"]
        if kind is None:
            return targets, None
        return targets, loads_record(_ORDERS[kind], doc["message"])
    except (ValueError, KeyError, TypeError, RecursionError, CorruptEvent):
        return None
