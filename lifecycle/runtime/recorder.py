"""One rank's recorder: every event is committed to the journal, then logged through structlog."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from lifecycle.core.events import (
    Event,
    GateDecided,
    PlanBuilt,
    Stalled,
    StoredEvent,
    WarmupRecord,
)
from lifecycle.core.states import State
from lifecycle.store.writer import RankWriter

# Kinds that may wait in memory after `ready`, off the request path (see buffer_collectives).
RING_KINDS = frozenset({"collective_started", "collective_finished"})
DEBUG_KINDS = frozenset({"heartbeat", "collective_started", "collective_finished"})
WARNING_KINDS = frozenset({"stalled", "fault_injected"})
ERROR_KINDS = frozenset({"error"})


class Clock(Protocol):
    def wall(self) -> float: ...

    def mono_ns(self) -> int: ...


class SystemClock:
    def wall(self) -> float:
        return time.time()

    def mono_ns(self) -> int:
        return time.monotonic_ns()


Listener = Callable[[StoredEvent], None]


def _not_started() -> State:
    return State.CREATED


class Recorder:
    """Appends this rank's events in order; `record` returns once the event is on disk.

    After `buffer_collectives`, collective records go to a bounded in-memory ring instead and
    reach the journal in order when anything else is recorded, when the heartbeat flushes, or
    on error.
    """

    def __init__(
        self,
        writer: RankWriter,
        *,
        clock: Clock | None = None,
        logger: Any = None,
    ) -> None:
        self._writer = writer
        self._clock = clock or SystemClock()
        self._log = logger or structlog.get_logger("lifecycle").bind(
            run_id=writer.run_id, rank=writer.rank
        )
        self._lock = threading.RLock()
        self._ring: deque[tuple[Event, str, float, int]] | None = None
        self.ring_dropped = 0
        self._listeners: list[Listener] = []
        self._state_of: Callable[[], State] = _not_started

    @property
    def run_id(self) -> str:
        return self._writer.run_id

    @property
    def rank(self) -> int:
        return self._writer.rank

    @property
    def clock(self) -> Clock:
        return self._clock

    def follow(self, state_of: Callable[[], State]) -> None:
        """Stamp events with the state `state_of` reports (the rank's machine, which is the
        only holder of its state)."""
        self._state_of = state_of

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def record(self, event: Event, *, state: State | None = None) -> StoredEvent | None:
        """Commit one event (its envelope state is `state`, else the current state)."""
        stamp = (state or self._state_of()).value, self._clock.wall(), self._clock.mono_ns()
        with self._lock:
            if self._ring is not None and event.kind in RING_KINDS:
                if len(self._ring) == self._ring.maxlen:
                    self.ring_dropped += 1
                self._ring.append((event, *stamp))
                return None
            self._flush_locked()
            return self._append(event, *stamp)

    def journal_cost(self) -> tuple[int, float]:
        """Events written so far and the seconds spent committing them."""
        with self._lock:
            return self._writer.next_seq, self._writer.write_s

    def buffer_collectives(self, capacity: int) -> None:
        with self._lock:
            self._ring = deque(maxlen=capacity)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        if self._ring:
            batch = list(self._ring)
            self._ring.clear()
            self._publish(self._writer.append_batch(batch))

    def _append(self, event: Event, state: str, wall: float, mono: int) -> StoredEvent:
        stored = self._writer.append(event, state=state, wall_time=wall, mono_ns=mono)
        self._publish([stored])
        return stored

    def _publish(self, batch: list[StoredEvent]) -> None:
        for stored in batch:
            self._emit_log(stored)
            for listener in self._listeners:
                listener(stored)

    def _emit_log(self, stored: StoredEvent) -> None:
        kind = stored.kind
        level = (
            logging.DEBUG
            if kind in DEBUG_KINDS
            else logging.ERROR
            if kind in ERROR_KINDS
            else logging.WARNING
            if kind in WARNING_KINDS
            else logging.INFO
        )
        enabled = getattr(self._log, "is_enabled_for", None)
        if enabled is not None and not enabled(level):
            return  # filtered out: do not build what nobody reads
        self._log.log(level, kind, state=stored.state, seq=stored.seq, **log_fields(stored.event))

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
            self._writer.close()


def log_fields(event: Event) -> dict[str, Any]:
    """What a log line shows of an event: its fields, with the bulky ones summarized (the
    journal keeps every field)."""
    match event:
        case GateDecided():
            return {
                "skip_reason": event.skip_reason,
                "local_skip_reason": event.local_skip_reason,
                "failed_gates": [g.name for g in event.gates if not g.passed],
                "device": event.platform.device,
                "free_bytes": event.platform.free_bytes,
                "peak_source": event.platform.peak_source,
            }
        case PlanBuilt():
            return {
                "skip_reason": event.skip_reason,
                "requests": [f"{r.role} {r.shape} x{r.steps}" for r in event.requests],
            }
        case WarmupRecord():
            return {
                "role": event.role,
                "shape": str(event.shape),
                "steps": event.steps,
                "total_s": round(event.total_s, 4),
                "stages": {s.name: round(s.seconds, 4) for s in event.stages if s.ran},
                "peak_bytes": event.peak_bytes,
                "baseline_bytes": event.baseline_bytes,
                "memory_source": event.memory_source,
            }
        case Stalled():
            return {
                "in_state_s": event.in_state_s,
                "deadline_s": event.deadline_s,
                "pending": _loggable(event.pending),
                "threads": len(event.threads),
            }
        case _:
            return {
                f.name: _loggable(getattr(event, f.name))
                for f in dataclasses.fields(event)
                if f.name != "traceback"
            }


def _loggable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
        return [dataclasses.asdict(v) for v in value]
    return value
