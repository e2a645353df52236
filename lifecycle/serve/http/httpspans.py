"""Each POST /generate as a SERVER span of the run's trace (lifecycle.runtime.telemetry.tracing),
sent by the HTTP front: a child of the client's span when the client sent a W3C `traceparent`,
else of the run's root span; the ranks' spans of the request are its children (its traceparent
travels in the Generate message). Attributes follow OpenTelemetry's HTTP server conventions;
the body (the prompt) and the query are never read into a span."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.runtime.telemetry.tracing import (
    ATTRIBUTE_PREFIX,
    Tracing,
    run_span_id_of,
    set_failed,
    trace_id_of,
)

ROUTE = "/generate"
STATE_KEY = "lifecycle_span"  # where the handler finds the request's span (scope["state"])


class GenerateSpan:
    """One /generate's span: the traceparent the ranks join, and what the handler says of it."""

    def __init__(
        self, span: Any = None, traceparent: str | None = None, *, client_named: bool = False
    ) -> None:
        self._span = span
        self.traceparent = traceparent  # None: no span (traces are not sent)
        self._client_named = client_named  # whether the client sent an X-Request-ID
        self._failure: str | None = None

    def name_request(self, request_id: str) -> None:
        """The request's id, under the lifecycle's attribute; as the X-Request-ID header's
        only when the client sent one (an id made here is no header of the request)."""
        attributes: dict[str, Any] = {f"{ATTRIBUTE_PREFIX}request_id": request_id}
        if self._client_named:
            attributes["http.request.header.x-request-id"] = (request_id,)
        self._set(attributes)

    def fail(self, description: str) -> None:
        """The request was refused or cut short although its answer is not a 5xx (an
        admission refusal): the span's status is an error."""
        self._failure = description

    def end(self, status: int) -> None:
        span = self._span
        if span is None:
            return
        with contextlib.suppress(Exception):  # instrumentation never raises into the server
            span.set_attribute("http.response.status_code", status)
            failure = self._failure or (f"HTTP {status}" if status >= 500 or not status else None)
            if failure is not None:
                span.set_attribute("error.type", str(status) if status else "no response")
                set_failed(span, failure)
            span.end()

    def _set(self, attributes: dict[str, Any]) -> None:
        if self._span is not None:
            with contextlib.suppress(Exception):
                self._span.set_attributes(attributes)


def configure_once_ready(
    tracing: Tracing, *, ready: Callable[[], bool], over: Callable[[], bool], poll_s: float
) -> threading.Thread:
    """Import and configure the front's SDK in a thread of its own once `ready` (every rank
    serving), or not at all when `over` comes first: off the ranks' path to ready, whose
    imports it would slow on a host of few cores, and before the first request, which would
    otherwise pay it."""

    def wait_then_configure() -> None:
        while not over():
            if ready():
                tracing.configure()
                return
            threading.Event().wait(poll_s)

    thread = threading.Thread(target=wait_then_configure, name="tracing-configure", daemon=True)
    thread.start()
    return thread


def span_of(scope_state: Any) -> GenerateSpan:
    """The span the middleware made for this request; one that records nothing otherwise."""
    found = getattr(scope_state, STATE_KEY, None)
    return found if isinstance(found, GenerateSpan) else GenerateSpan()


def process_tracing() -> Tracing | None:
    """This process's tracing when it is a rank's (rank 0's HTTP front under torchrun)."""
    from lifecycle.runtime.telemetry.rankspans import current_rank_spans

    spans = current_rank_spans()
    return None if spans is None else spans.tracing


class GenerateSpans:
    """ASGI middleware: a span for each POST /generate, ended when its answer starts (or the
    connection ends without one)."""

    def __init__(self, app: ASGIApp, *, tracing: Tracing | None, run_id: Callable[[], str]) -> None:
        self.app = app
        self._tracing = tracing
        self._run_id = run_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracing = self._tracing
        if (
            tracing is None
            or scope["type"] != "http"
            or scope["path"] != ROUTE
            or scope["method"] != "POST"
        ):
            await self.app(scope, receive, send)
            return
        if not tracing.configured:
            # A rank's SDK is configured once its startup is over: a request that comes before
            # it is waits for it off the event loop.
            await anyio.to_thread.run_sync(tracing.configure)
        headers = {name.lower(): value for name, value in scope["headers"]}
        span = self._start(tracing, scope, headers)
        scope.setdefault("state", {})[STATE_KEY] = span
        status = 0

        async def noted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noted_send)
        finally:
            span.end(status)

    def _start(self, tracing: Tracing, scope: Scope, headers: dict[bytes, bytes]) -> GenerateSpan:
        try:
            from opentelemetry import trace
            from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            propagator = TraceContextTextMapPropagator()
            carrier = {
                name: headers[name.encode()].decode("latin-1")
                for name in ("traceparent", "tracestate")
                if name.encode() in headers
            }
            parent = propagator.extract(carrier)
            if not trace.get_current_span(parent).get_span_context().is_valid:
                run_id = self._run_id()
                root = SpanContext(
                    trace_id=trace_id_of(run_id),
                    span_id=run_span_id_of(run_id),
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
                parent = trace.set_span_in_context(NonRecordingSpan(root))
            client = scope.get("client")
            span = tracing.tracer.start_span(
                f"POST {ROUTE}",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={
                    "http.request.method": "POST",
                    "http.route": ROUTE,
                    "url.path": ROUTE,
                    "url.scheme": str(scope.get("scheme", "http")),
                    **({"client.address": str(client[0])} if client else {}),
                    f"{ATTRIBUTE_PREFIX}run_id": self._run_id(),
                },
            )
            down: dict[str, str] = {}
            propagator.inject(down, context=trace.set_span_in_context(span))
            named = b"x-request-id" in headers
            return GenerateSpan(span, down.get("traceparent"), client_named=named)
        except Exception:  # a span that cannot be made is one the trace lacks
            return GenerateSpan()
