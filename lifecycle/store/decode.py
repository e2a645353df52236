"""Event rows as readers select them, and their decoding into stored events: envelopes checked,
payloads decoded, what does not decode kept as an unknown event and said."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Text, select, type_coerce

from lifecycle.core.format.codec import UNKNOWN_KIND, decode_or_unknown
from lifecycle.core.format.events import StoredEvent, UnknownEvent
from lifecycle.store.backends.schema import events
from lifecycle.store.rows import is_int, is_number

# What a journal's own bytes can make the decoder raise (a BLOB where text belongs, JSON nested
# past the recursion limit, a number out of range): the journal is bad input, not a bug here.
DATA_ERRORS = (ValueError, TypeError, RecursionError, OverflowError)

# An event row as readers select it.
EVENT_ROW = select(
    events.c.run_id,
    events.c.rank,
    events.c.seq,
    events.c.wall_time,
    events.c.mono_ns,
    events.c.kind,
    events.c.version,
    events.c.state,
    type_coerce(events.c.data, Text),
)


def decode_row(row: Any, location: str) -> tuple[StoredEvent | None, list[str]]:
    """The stored event of one EVENT_ROW row (None when its envelope is malformed), and what is
    wrong with the row, for the reader to report."""
    run_id, rank, seq, wall_time, mono_ns, kind, version, state, data = row
    if not (
        isinstance(run_id, str)
        and is_int(rank)
        and is_int(seq)
        and is_number(wall_time)
        and is_int(mono_ns)
        and isinstance(kind, str)
        and is_int(version)
        and isinstance(state, str)
    ):
        return None, [f"run {run_id!r} rank {rank!r} seq {seq!r}: bad envelope"]
    problems = []
    try:
        payload = data if isinstance(data, str) else json.dumps(data)
    except (TypeError, ValueError, RecursionError):
        # A BLOB or worse: kept as an undecodable event, and said.
        problems.append(f"{location}: run {run_id} rank {rank} seq {seq}: payload is not JSON text")
        payload = repr(data)[:200]
    event = decode_or_unknown(kind, version, payload)
    if isinstance(event, UnknownEvent) and event.reason != UNKNOWN_KIND:
        problems.append(
            f"{location}: run {run_id} rank {rank} seq {seq}: {kind} {event.reason}"[:300]
        )
    stored = StoredEvent(
        run_id=run_id,
        rank=rank,
        seq=seq,
        wall_time=float(wall_time),
        mono_ns=mono_ns,
        state=state,
        event=event,
    )
    return stored, problems
