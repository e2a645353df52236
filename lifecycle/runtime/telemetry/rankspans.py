"""A rank's startup as spans of its run's trace (`lifecycle.runtime.telemetry.tracing`): each
journal event opens or ends one. Under the rank's span (`lifecycle.rank`, under the run's root span
`lifecycle.run`, which rank 0 sends) come its phases before the journal opened, its states,
their actions, each component load and each warmup request; errors, aborts and stalls are span
events with an error status. After ready, each request a rank serves is a span under its
client's trace when the client sent one (W3C `traceparent`). The recorder's thread only holds
the events: their spans are made on a thread of their own once the startup is over, each with
the times its events carry."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format import events as ev
from lifecycle.core.format.records import PhaseTime
from lifecycle.core.format.states import TERMINAL_STATES, State
from lifecycle.runtime.telemetry.tracing import (
    ATTRIBUTE_PREFIX,
    CONFIGURE_AFTER_S,
    FLUSH_WITHIN_S,
    SpanFeed,
    Tracing,
    nanos,
    run_span_id_of,
    set_failed,
    trace_id_of,
)

# The events a rank's spans are made of: the only ones its recorder's thread holds for them.
TRACED: frozenset[type[ev.Event]] = frozenset(
    {
        ev.RunStarted,
        ev.Transition,
        ev.ActionStarted,
        ev.ActionFinished,
        ev.LoadStarted,
        ev.LoadFinished,
        ev.Expectations,
        ev.WarmupRecord,
        ev.Error,
        ev.Aborted,
        ev.Stalled,
        ev.RequestStarted,
        ev.RequestFinished,
    }
)
_TERMINAL = frozenset(state.value for state in TERMINAL_STATES)

# This process's rank spans, once made (one rank per process): where a served request joins its
# client's trace.
_CURRENT: list[RankSpans | None] = [None]


def current_rank_spans() -> RankSpans | None:
    return _CURRENT[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Joined:
    """A request's parent: the W3C traceparent of its server's span."""

    request_id: str
    traceparent: str


def _ends_startup(event: ev.Event) -> bool:
    """Whether the startup is over with `event`: its ready action done, or the rank ended."""
    if isinstance(event, ev.ActionFinished):
        return event.action == "mark-ready"
    return isinstance(event, ev.Transition) and event.dest in _TERMINAL


class RankSpans:
    """A recorder listener: one rank's events as spans of the run's trace, made once its
    startup is over (or `configure_after_s` into it), then as they come."""

    def __init__(
        self,
        tracing: Tracing,
        *,
        run_id: str,
        rank: int,
        attributes: Mapping[str, str | int],
        configure_after_s: float = CONFIGURE_AFTER_S,
    ) -> None:
        self._tracing = tracing
        self._run_id = run_id
        self._rank = rank
        self._attributes = {
            f"{ATTRIBUTE_PREFIX}run_id": run_id,
            f"{ATTRIBUTE_PREFIX}rank": rank,
            **{f"{ATTRIBUTE_PREFIX}{k}": v for k, v in attributes.items()},
        }
        self._trace: Any = None  # opentelemetry.trace, imported with the first span
        self._run_context: Any = None
        self._launched: float | None = None
        self._rank_span: Any = None
        self._state_span: Any = None
        self._actions: dict[str, Any] = {}
        self._loads: dict[str, Any] = {}
        self._requests: dict[str, Any] = {}
        self._request_contexts: dict[str, Any] = {}  # a request's parent, from its traceparent
        self._request_errors: dict[str, str] = {}  # a request's error, for its span's status
        self._feed: SpanFeed[ev.StoredEvent | _Joined] = SpanFeed(
            tracing, self._convert, configure_after_s=configure_after_s
        )
        _CURRENT[0] = self

    def __call__(self, stored: ev.StoredEvent) -> None:
        """Holds an event its spans need: an append on the recording thread, nothing more."""
        event = stored.event
        if type(event) in TRACED:
            self._feed.put(stored, due=_ends_startup(event))

    def close(self, *, within_s: float = FLUSH_WITHIN_S) -> None:
        """Make the spans still held and send them, in at most `within_s` in all."""
        self._feed.close(within_s=within_s)

    def _convert(self, record: ev.StoredEvent | _Joined) -> None:
        if self._trace is None:
            self._bind()
        if isinstance(record, _Joined):
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            context = TraceContextTextMapPropagator().extract({"traceparent": record.traceparent})
            self._request_contexts[record.request_id] = context
        else:
            self._on(record)

    def _bind(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

        root = SpanContext(
            trace_id=trace_id_of(self._run_id),
            span_id=run_span_id_of(self._run_id),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        self._run_context = trace.set_span_in_context(NonRecordingSpan(root))
        self._trace = trace

    def _on(self, stored: ev.StoredEvent) -> None:
        event, wall = stored.event, stored.wall_time
        if isinstance(event, ev.RunStarted):
            self._start_rank(event, wall)
        elif self._rank_span is None:
            if self._launched is not None:
                self._serving(event, wall)  # after the startup's end: the requests it serves
            return
        elif isinstance(event, ev.Transition):
            self._enter(State(event.dest), wall)
        elif isinstance(event, ev.ActionStarted):
            self._actions[event.action] = self._child(
                f"lifecycle.action {event.action}", wall, parent=self._state_span
            )
        elif isinstance(event, ev.ActionFinished):
            self._finish_action(event, wall)
        elif isinstance(event, ev.LoadStarted):
            self._start_load(event, wall)
        elif isinstance(event, ev.LoadFinished):
            self._finish_load(event, wall)
        elif isinstance(event, ev.Expectations):
            fingerprint, _, path = event.key.partition("/")
            self._rank_span.set_attributes(
                {f"{ATTRIBUTE_PREFIX}fingerprint": fingerprint, f"{ATTRIBUTE_PREFIX}path": path}
            )
        elif isinstance(event, ev.WarmupRecord):
            self._warmup(event, wall)
        elif isinstance(event, ev.Error):
            self._error(event, wall)
        elif isinstance(event, ev.Aborted):
            self._aborted(event, wall)
        elif isinstance(event, ev.Stalled):
            self._event(
                "lifecycle.stalled", wall, {f"{ATTRIBUTE_PREFIX}state": stored.state}, error=False
            )

    def _finish_action(self, event: ev.ActionFinished, wall: float) -> None:
        """An action's span ends (failed when the action did); the ready action ends the
        startup."""
        span = self._actions.pop(event.action, None)
        if span is not None:
            if not event.ok:
                set_failed(span, f"{event.action} failed")
            span.end(end_time=nanos(wall))
        if event.action == "mark-ready":
            self._end_startup(wall, outcome="ready")

    def _start_load(self, event: ev.LoadStarted, wall: float) -> None:
        self._loads[event.component] = self._child(
            f"lifecycle.load {event.component}",
            wall,
            parent=self._innermost(),
            component=event.component,
            files=len(event.files),
            bytes=event.bytes,
        )

    def _finish_load(self, event: ev.LoadFinished, wall: float) -> None:
        """A component's load span ends with what the load measured."""
        span = self._loads.pop(event.component, None)
        if span is not None:
            span.set_attributes(
                {
                    f"{ATTRIBUTE_PREFIX}bytes": event.bytes,
                    f"{ATTRIBUTE_PREFIX}read_s": event.read_s,
                    f"{ATTRIBUTE_PREFIX}device_s": event.device_s,
                    f"{ATTRIBUTE_PREFIX}dtype": event.dtype or "",
                }
            )
            if not event.ok:
                set_failed(span, f"loading {event.component} failed")
            span.end(end_time=nanos(wall))

    def _warmup(self, event: ev.WarmupRecord, wall: float) -> None:
        """A warmup request's span, made whole when its record is written at its end."""
        span = self._child(
            f"lifecycle.warmup {event.role}",
            wall - event.total_s,
            parent=self._innermost(),
            shape=str(event.shape),
            steps=event.steps,
            peak_bytes=event.peak_bytes if event.peak_bytes is not None else -1,
        )
        span.end(end_time=nanos(wall))

    def _error(self, event: ev.Error, wall: float) -> None:
        """An error as an `exception` span event; a fatal one fails its span."""
        self._event(
            "exception",
            wall,
            {
                "exception.type": event.error_type,
                "exception.message": event.message[:1000],
                f"{ATTRIBUTE_PREFIX}error_kind": event.error_kind,
            },
            error=event.fatal,
        )

    def _aborted(self, event: ev.Aborted, wall: float) -> None:
        """The agreed abort as a span event that fails its span, naming the rank that failed."""
        self._event(
            "lifecycle.aborted",
            wall,
            {
                f"{ATTRIBUTE_PREFIX}failed_rank": -1
                if event.failed_rank is None
                else event.failed_rank,
                f"{ATTRIBUTE_PREFIX}failed_state": event.failed_state or "",
                "exception.message": event.message[:1000],
            },
            error=True,
        )

    def _serving(self, event: ev.Event, wall: float) -> None:
        """After ready: a span per request served, under the trace its server span names (see
        join_request), with its errors (a cancel) as span events."""
        if isinstance(event, ev.RequestStarted):
            self._requests[event.request_id] = self._tracing.tracer.start_span(
                "lifecycle.request",
                context=self._request_contexts.pop(event.request_id, self._run_context),
                start_time=nanos(wall),
                attributes={
                    **self._attributes,
                    f"{ATTRIBUTE_PREFIX}request_id": event.request_id,
                    f"{ATTRIBUTE_PREFIX}shape": str(event.shape),
                    f"{ATTRIBUTE_PREFIX}steps": event.steps,
                },
            )
        elif isinstance(event, ev.RequestFinished):
            span = self._requests.pop(event.request_id, None)
            error = self._request_errors.pop(event.request_id, "")
            if span is not None:
                if not event.ok:
                    set_failed(span, error or f"request {event.request_id} failed")
                span.end(end_time=nanos(wall))
        elif isinstance(event, ev.Error) and self._requests:
            request_id, span = next(reversed(self._requests.items()))
            span.add_event(
                "exception",
                attributes={
                    "exception.type": event.error_type,
                    "exception.message": event.message[:1000],
                    f"{ATTRIBUTE_PREFIX}error_kind": event.error_kind,
                },
                timestamp=nanos(wall),
            )
            self._request_errors[request_id] = event.message

    @property
    def tracing(self) -> Tracing:
        """The process's tracing (rank 0's HTTP front under torchrun sends its spans with it)."""
        return self._tracing

    def join_request(self, request_id: str, traceparent: str | None) -> None:
        """Put the spans of request `request_id` under the trace its client sent (a W3C
        `traceparent`), else under the run's."""
        if traceparent:
            self._feed.put(_Joined(request_id=request_id, traceparent=traceparent))

    def _start_rank(self, event: ev.RunStarted, wall: float) -> None:
        launched = event.launcher_started_wall or event.process_started_wall or wall
        self._launched = launched
        self._rank_span = self._tracing.tracer.start_span(
            "lifecycle.rank",
            context=self._run_context,
            start_time=nanos(launched),
            attributes={**self._attributes, "host.name": event.host},
        )
        self._state_span = self._child(f"lifecycle.state {State.CREATED.value}", wall, parent=None)
        # The phases before the journal opened, one after another from the process's start;
        # the launcher's own before it (spawn), when the rank did not launch itself.
        since = event.process_started_wall or launched
        phases = list(event.phases)
        if since > launched:
            phases.insert(0, PhaseTime(name="spawn", seconds=since - launched))
            since = launched
        for phase in phases:
            span = self._child(f"lifecycle.phase {phase.name}", since, parent=None)
            since += phase.seconds
            span.end(end_time=nanos(since))

    def _enter(self, state: State, wall: float) -> None:
        if self._state_span is not None:
            self._state_span.end(end_time=nanos(wall))
            self._state_span = None
        if state in TERMINAL_STATES:
            if state is State.FAILED:
                self._end_startup(wall, outcome="failed")
            return
        self._state_span = self._child(f"lifecycle.state {state.value}", wall, parent=None)

    def _end_startup(self, wall: float, *, outcome: str) -> None:
        """The rank's startup is over (its ready action done, or failed): its span ends, and
        rank 0 sends the run's root span."""
        span = self._rank_span
        if span is None:
            return
        for action in self._actions.values():
            action.end(end_time=nanos(wall))
        self._actions.clear()
        if self._state_span is not None and outcome != "ready":
            self._state_span.end(end_time=nanos(wall))
            self._state_span = None
        span.set_attribute(f"{ATTRIBUTE_PREFIX}outcome", outcome)
        if outcome != "ready":
            set_failed(span, f"rank {self._rank} {outcome}")
        span.end(end_time=nanos(wall))
        self._rank_span = None
        if self._state_span is not None:  # ready goes on while the server serves
            self._state_span.end(end_time=nanos(wall))
            self._state_span = None
        if self._rank == 0:
            self._send_run(wall, outcome)

    def _send_run(self, wall: float, outcome: str) -> None:
        with self._tracing.preset_ids(
            trace_id=trace_id_of(self._run_id), span_id=run_span_id_of(self._run_id)
        ):
            run = self._tracing.tracer.start_span(
                "lifecycle.run",
                context=self._trace.set_span_in_context(self._trace.INVALID_SPAN),
                start_time=nanos(self._launched or wall),
                attributes={
                    k: v for k, v in self._attributes.items() if k != f"{ATTRIBUTE_PREFIX}rank"
                },
            )
        run.set_attribute(f"{ATTRIBUTE_PREFIX}outcome", outcome)
        if outcome != "ready":
            set_failed(run, f"the startup {outcome}")
        run.end(end_time=nanos(wall))

    def _innermost(self) -> Any:
        if self._actions:
            return next(reversed(self._actions.values()))
        return self._state_span

    def _child(self, name: str, start: float, *, parent: Any, **extra: Any) -> Any:
        parent = parent if parent is not None else self._rank_span
        return self._tracing.tracer.start_span(
            name,
            context=self._trace.set_span_in_context(parent),
            start_time=nanos(start),
            attributes={
                **self._attributes,
                **{f"{ATTRIBUTE_PREFIX}{k}": v for k, v in extra.items()},
            },
        )

    def _event(self, name: str, wall: float, attributes: dict[str, Any], *, error: bool) -> None:
        span = self._innermost() or self._rank_span
        span.add_event(name, attributes=attributes, timestamp=nanos(wall))
        if error:
            set_failed(span, str(attributes.get("exception.message", name)))
