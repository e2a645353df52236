"""One rank's recorder: every event is committed to the journal, then logged through structlog.

After ready, collective records stay in a bounded ring, as PyTorch's Flight Recorder keeps
them, and reach the journal only on trouble: an error, a stall, a failed request, a shutdown
with a collective pending, or an explicit dump (SIGUSR1, `POST /debug/dump`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from lifecycle.core.decisions.learnedshapes import LearnedTraffic
from lifecycle.core.errors import ErrorKind, JournalError
from lifecycle.core.format.events import (
    Aborted,
    CollectivesDumped,
    CollectiveStarted,
    Error,
    Event,
    GateDecided,
    PlanBuilt,
    RequestFinished,
    ResidencyEvent,
    Shutdown,
    Stalled,
    StoredEvent,
    WarmupRecord,
)
from lifecycle.core.format.states import State
from lifecycle.runtime.clock import (
    Clock,
    SystemClock,
)
from lifecycle.runtime.telemetry.rankmetrics import JOURNAL_APPEND_SECONDS, JOURNAL_WRITE_ERRORS
from lifecycle.store.learned.artifacts import ArtifactStore
from lifecycle.store.learned.history import HistoryRead
from lifecycle.store.writer import RankWriter

# Kinds that stay in the ring after `ready` (see keep_collectives_in_ring).
RING_KINDS = frozenset({"collective_started", "collective_finished"})
DEBUG_KINDS = frozenset({"heartbeat", "collective_started", "collective_finished"})
WARNING_KINDS = frozenset({"stalled", "fault_injected", "collectives_dumped"})
ERROR_KINDS = frozenset({"error"})


Listener = Callable[[StoredEvent], None]


def dump_reason(event: Event, ring: deque[tuple[Event, str, float, int]]) -> str | None:
    """Why recording `event` writes the ring first, if it does: the trouble it reports."""
    match event:
        # A message dropped from the store is news of the store, not of this rank's collectives.
        case Error() if event.error_kind != ErrorKind.UNAUTHENTICATED:
            return "error"
        case Shutdown() if _collective_pending(ring):
            return "shutdown"
    return _group_trouble(event)


def trouble(event: Event) -> str | None:
    """The trouble `event` reports, for what else a rank keeps for it (PyTorch's Flight
    Recorder dump): a fatal error's kind, the group aborted, a stall, a failed request, a stop
    by signal."""
    match event:
        case Error(fatal=True):
            return event.error_kind
        case Shutdown(signal=str()):
            return "signal"
    return _group_trouble(event)


def _group_trouble(event: Event) -> str | None:
    """The trouble both answers name alike: the group aborted, a stall, a request that
    failed."""
    match event:
        case Aborted():
            return "aborted"
        case Stalled():
            return "stall"
        case RequestFinished(ok=False):
            return "request-failed"
    return None


def _collective_pending(ring: deque[tuple[Event, str, float, int]]) -> bool:
    """Whether the ring's latest collective record is a start with no finish after it."""
    return bool(ring) and isinstance(ring[-1][0], CollectiveStarted)


class Recorder:
    """Appends this rank's events in order; `record` returns once the event is on disk.

    After `keep_collectives_in_ring`, collective records go to a bounded in-memory ring
    instead, and reach the journal (in one transaction, after a `collectives_dumped` event)
    only when `dump_reason` says an event reports trouble, or on `dump`.
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
        self.ring_dropped = 0  # records that fell out of the ring since its last dump
        self._listeners: list[Listener] = []
        self._on_trouble: Callable[[str], object] | None = None
        # The state the journal holds for this rank: that of its latest transition. Events are
        # stamped with it under the same lock that orders appends, so that an event appended
        # after a transition never carries the state before it (the heartbeat thread records
        # beside the main thread, whose machine moves only after its transition is journaled).
        self._state = State.CREATED
        self._offset_s = 0.0  # this rank's clock minus rank 0's, once measured
        # Made now, so that /metrics shows this rank's zero errors before any append fails.
        self._append_seconds = JOURNAL_APPEND_SECONDS.labels(rank=str(writer.rank))
        self._write_errors = JOURNAL_WRITE_ERRORS.labels(rank=str(writer.rank))

    @property
    def run_id(self) -> str:
        return self._writer.run_id

    @property
    def rank(self) -> int:
        return self._writer.rank

    @property
    def clock(self) -> Clock:
        return self._clock

    def residency_history(self, model: str) -> list[StoredEvent]:
        """The journal's residency events of `model`'s newest runs, newest first: what a
        startup decides the reuse of a verified plan from."""
        return self._writer.residency_history(model)

    def planned_inputs(self, run_id: str) -> list[StoredEvent]:
        """Every rank's `residency_planned` events of `run_id`: the inputs its plan came from."""
        return self._writer.planned_inputs(run_id)

    def startup_history(self, key: str, *, ranks: int) -> HistoryRead:
        """The journal's healthy startups of `key` (fingerprint and path), newest first: what
        a startup learns its states' deadlines from."""
        return self._writer.startup_history(key, ranks=ranks)

    def served(self, fingerprint_key: str) -> LearnedTraffic:
        """What the fingerprint's newest healthy runs served: the shapes to warm."""
        return self._writer.served(fingerprint_key)

    def reference_output(self, reference_key: str) -> tuple[str, str] | None:
        """This rank's reference output of `reference_key` and the run that first journaled
        it; None where the journal holds none."""
        return self._writer.reference_output(reference_key, rank=self.rank)

    def artifacts(self) -> ArtifactStore:
        """The journal's compile artifacts."""
        return self._writer.artifacts()

    def beat_in_place(self) -> None:
        """A heartbeat that journals no event: its time, stamped as an event would be, kept in
        place in the rank's summary row (see RankWriter.beat)."""
        with self._lock:
            self._writer.beat(self._stamp()[1])

    def align_clock(self, offset_s: float) -> None:
        """From now on stamp events on rank 0's clock: this clock's time less `offset_s`."""
        with self._lock:
            self._offset_s = offset_s

    @property
    def state(self) -> State:
        """The state this rank's journal holds: that of the latest transition recorded."""
        return self._state

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def on_trouble(self, call: Callable[[str], object]) -> None:
        """Call `call(reason)` after recording an event that reports trouble, and on `dump`."""
        self._on_trouble = call

    def record(self, event: Event, *, state: State | None = None) -> StoredEvent | None:
        """Commit one event. A transition passes the state it enters as `state`: this event
        and every later one carry it; any other event carries the state journaled last."""
        stored = self._record(event, state)
        if self._on_trouble is not None and (reason := trouble(event)) is not None:
            self._on_trouble(reason)
        return stored

    def _stamp(self, state: State | None = None) -> tuple[str, float, int]:
        return (
            (state or self._state).value,
            self._clock.wall() - self._offset_s,
            self._clock.mono_ns(),
        )

    def _record(self, event: Event, state: State | None) -> StoredEvent | None:
        with self._lock:
            stamp = self._stamp(state)
            ring = self._ring
            if ring is not None and event.kind in RING_KINDS:
                if len(ring) == ring.maxlen:
                    self.ring_dropped += 1
                ring.append((event, *stamp))
                return None
            reason = None if ring is None else dump_reason(event, ring)
            if reason is not None and (ring or self.ring_dropped):
                items = [*self._dump_items(reason, stamp), (event, *stamp)]
            else:
                items = [(event, *stamp)]
            stored = self._publish(self._append(items))[-1]
            if state is not None:
                self._state = state
            return stored

    def _append(self, items: list[tuple[Event, str, float, int]]) -> list[StoredEvent]:
        """Commit `items` in one transaction, timed and counted for /metrics."""
        started = time.perf_counter()
        try:
            stored = self._writer.append_batch(items)
        except JournalError:
            self._write_errors.inc()
            raise
        self._append_seconds.observe(time.perf_counter() - started)
        return stored

    def journal_cost(self) -> tuple[int, float]:
        """Events written so far and the seconds spent committing them."""
        with self._lock:
            return self._writer.next_seq, self._writer.write_s

    def keep_collectives_in_ring(self, capacity: int) -> None:
        """From now on (after ready), keep collective records in a ring of `capacity`."""
        with self._lock:
            self._ring = deque(maxlen=capacity)

    @property
    def ring_active(self) -> bool:
        """Whether collective records go to the ring (after ready)."""
        return self._ring is not None

    def ring_entries(self, group: str, *, first: int, last: int) -> dict[int, float]:
        """When this rank entered each of `group`'s collectives `first`..`last` (their
        sequence numbers) that its ring still holds, on rank 0's clock."""
        with self._lock:
            records = list(self._ring or ())
        return {
            event.group_seq: wall
            for event, _, wall, _ in records
            if isinstance(event, CollectiveStarted)
            and event.group == group
            and first <= event.group_seq <= last
        }

    def dump(self, reason: str) -> int:
        """Write the ring to the journal now (and what else is kept for trouble); how many
        collective records the ring held."""
        written = 0
        with self._lock:
            if self._ring is not None:  # before ready every collective record is journaled
                items = self._dump_items(reason, self._stamp())
                self._publish(self._append(items))
                written = len(items) - 1
        if self._on_trouble is not None:
            self._on_trouble(reason)
        return written

    def _dump_items(
        self, reason: str, stamp: tuple[str, float, int]
    ) -> list[tuple[Event, str, float, int]]:
        """The dump marker and the ring's records, oldest first; the ring starts over."""
        assert self._ring is not None
        records = list(self._ring)
        marker = CollectivesDumped(
            reason=reason,
            records=len(records),
            dropped=self.ring_dropped,
            capacity=self._ring.maxlen or 0,
        )
        self._ring.clear()
        self.ring_dropped = 0
        return [(marker, *stamp), *records]

    def _publish(self, batch: list[StoredEvent]) -> list[StoredEvent]:
        for stored in batch:
            self._emit_log(stored)
            for listener in self._listeners:
                listener(stored)
        return batch

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
        """Close the writer; what the ring holds after a healthy run is not written."""
        with self._lock:
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
        case ResidencyEvent():
            plan = event.plan
            summary = {
                "plan": plan.plan_id,
                "fits": plan.fits,
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "budget_bytes": plan.budget_bytes,
                "fingerprint": event.fingerprint.key,
            }
            skip = {"plan", "fingerprint", "given"}
            return summary | {
                f.name: _loggable(getattr(event, f.name))
                for f in dataclasses.fields(event)
                if f.name not in skip
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
