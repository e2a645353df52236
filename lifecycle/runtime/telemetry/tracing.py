"""OpenTelemetry's SDK as the lifecycle uses it (the `otel` extra): configured once per process
from the standard `OTEL_*` variables, exporting over OTLP/HTTP, best effort (spans are queued
and sent by the SDK's own thread, a collector that is down or slow costs one warning line, and
the process's end gives the export a bounded time, never more); a rank's records held until its
startup is over and only then made into spans (`SpanFeed`), so that the export costs the path to
ready nothing but an append per event; and the run's trace id, derived from the run id, so that
every rank and node joins one trace without talking.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import urlsplit, urlunsplit

from lifecycle.core.command import extra

ATTRIBUTE_PREFIX = "lifecycle."
# At a process's end, all that the export may cost it: the spans still being made, their
# flush, the exporter's retries and its shutdown.
FLUSH_WITHIN_S = 2.0
EXPORT_TIMEOUT_S = 5.0  # one export's bound, unless OTEL_EXPORTER_OTLP_TIMEOUT says otherwise
# A startup still going this long after its journal opened gets its SDK then, so that a long
# startup's spans reach the collector while it runs: the SDK's import (0.2 to 0.4 s of CPU) is
# then well under 1 % of it.
CONFIGURE_AFTER_S = 60.0
SCHEDULE_DELAY_MS = 500  # once configured: how long an ended span waits for others to go with
EXTRA = extra("otel")
PROTOCOLS = ("http/protobuf",)
# What the export imports, looked up (not imported) when it is asked for.
SDK_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")

Record = TypeVar("Record")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportSettings:
    """Where spans go, as the OTEL_* variables say it (the exporter reads the rest itself)."""

    endpoint: str  # as shown: no credentials, at most 200 characters


def export_settings(env: Mapping[str, str]) -> tuple[ExportSettings | None, str | None]:
    """Whether to export, from the standard variables: (settings, None) when an endpoint is
    set and nothing turns export off; (None, why not) when it is asked for in a way this
    lifecycle cannot serve (another protocol); (None, None) when it is not asked for."""
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not endpoint:
        return None, None
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None, None
    exporters = [e.strip() for e in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    if "otlp" not in exporters:
        return None, None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in PROTOCOLS:
        return None, f"OTLP protocol {protocol[:40]!r} is not supported (use http/protobuf)"
    return ExportSettings(endpoint=shown_endpoint(endpoint)), None


def shown_endpoint(url: str) -> str:
    """An endpoint as a warning echoes it: no credentials, at most 200 characters."""
    bare = without_credentials(url)
    return bare if len(bare) <= 200 else bare[:199] + "…"


def without_credentials(url: str) -> str:
    """A URL as messages and spans may show it: no user or password, no query."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))
    except ValueError:
        return "(an endpoint that is not a URL)"


def trace_id_of(run_id: str) -> int:
    """The run's trace id: the same on every rank and node, from the run id alone."""
    value = int.from_bytes(hashlib.sha256(f"lifecycle-trace {run_id}".encode()).digest()[:16])
    return value or 1


def run_span_id_of(run_id: str) -> int:
    """The id of the run's root span (`lifecycle.run`), which every rank's span names as its
    parent before rank 0 has sent it."""
    value = int.from_bytes(hashlib.sha256(f"lifecycle-run {run_id}".encode()).digest()[:8])
    return value or 1


def nanos(wall: float) -> int:
    return int(wall * 1e9)


def set_failed(span: Any, description: str) -> None:
    """Mark `span` failed, with the start of `description` as its status message."""
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, description[:300]))


def missing_package(names: tuple[str, ...]) -> str | None:
    """The first of `names` that cannot be imported, found without importing it."""
    for name in names:
        try:
            found = importlib.util.find_spec(name)
        except ImportError:
            found = None
        if found is None:
            return name
    return None


class Tracing:
    """The OpenTelemetry SDK of one process, configured once: at once (`start`, an entry point
    that sends spans from its first moment) or the first time it is needed (`deferred`)."""

    def __init__(
        self,
        settings: ExportSettings,
        *,
        service: str,
        timeout_s: float | None,
        warn: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self._service = service
        self._timeout_s = timeout_s
        self._unsent = _SayUnsent(settings.endpoint, warn)
        self._warn = warn
        self._lock = threading.Lock()
        self._tried = False
        self._sdk: _Sdk | None = None

    @classmethod
    def deferred(cls, env: Mapping[str, str], *, warn: Callable[[str], None]) -> Tracing | None:
        """Tracing whose SDK is imported and configured only when first needed; None when
        export is not asked for, or cannot be (one warning line: the extra not installed,
        another protocol)."""
        settings, refused = export_settings(env)
        if settings is None:
            if refused is not None:
                warn(f"traces are not exported: {refused}")
            return None
        missing = missing_package(SDK_PACKAGES)
        if missing is not None:
            warn(f"traces are not exported: {missing} is not installed (pip install '{EXTRA}')")
            return None
        return cls(
            settings,
            service=env.get("OTEL_SERVICE_NAME", "lifecycle"),
            timeout_s=None if env.get("OTEL_EXPORTER_OTLP_TIMEOUT") else EXPORT_TIMEOUT_S,
            warn=warn,
        )

    @classmethod
    def start(cls, env: Mapping[str, str], *, warn: Callable[[str], None]) -> Tracing | None:
        """The SDK, configured now, exporting to where the variables say; None as for
        `deferred`, or when the SDK cannot be configured (one warning line)."""
        tracing = cls.deferred(env, warn=warn)
        return tracing if tracing is not None and tracing.configure() else None

    @property
    def configured(self) -> bool:
        return self._sdk is not None

    def configure(self) -> bool:
        """Import and configure the SDK, once, from any thread (a second caller waits for the
        first); whether it is configured."""
        return self._configured() is not None

    def _configured(self) -> _Sdk | None:
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._sdk = _configure(
                        service=self._service, timeout_s=self._timeout_s, unsent=self._unsent
                    )
                except ImportError as exc:
                    self._warn(
                        f"traces are not exported: {exc.name} is not installed"
                        f" (pip install '{EXTRA}')"
                    )
                except Exception as exc:  # instrumentation never raises into what it observes
                    self._warn(f"traces are not exported: {type(exc).__name__}: {exc}"[:300])
            return self._sdk

    @property
    def tracer(self) -> Any:
        """The SDK's tracer, configured first if need be; one that records nothing where the
        SDK could not be configured."""
        sdk = self._configured()
        if sdk is None:
            from opentelemetry.trace import NoOpTracer

            return NoOpTracer()
        return sdk.tracer

    @contextlib.contextmanager
    def preset_ids(self, *, trace_id: int, span_id: int) -> Iterator[None]:
        """The next span this thread starts gets these ids (the run's root span)."""
        sdk = self._configured()
        if sdk is None:
            yield
            return
        sdk.ids.preset(trace_id, span_id)
        try:
            yield
        finally:
            sdk.ids.preset(None, None)

    def close(
        self, *, within_s: float = FLUSH_WITHIN_S, first: Callable[[], object] | None = None
    ) -> None:
        """Send what is queued and stop, in at most `within_s` in all, `first` (the spans
        still being made) included: a collector that does not answer never holds up the
        process's end."""

        def finish() -> None:
            if first is not None:
                first()
            sdk = self._sdk
            if sdk is not None:
                with contextlib.suppress(Exception):
                    sdk.provider.force_flush(timeout_millis=int(within_s * 1000))
                    sdk.provider.shutdown()

        done = threading.Thread(target=finish, name="lifecycle-otel-flush", daemon=True)
        done.start()
        done.join(within_s)
        if done.is_alive():
            self._unsent.failed(f"still sending after {within_s:.0f} s, left unsent")


class SpanFeed(Generic[Record]):
    """Records made into spans by `convert` on a thread of its own, in the order they came.
    Until the SDK is configured they are only held (the recording thread appends, nothing
    more); it is configured when a record says it is time (`due`: the startup is over), once
    `configure_after_s` has passed, or at close. A record carries its own times, and so does
    the span made of it."""

    def __init__(
        self,
        tracing: Tracing,
        convert: Callable[[Record], None],
        *,
        configure_after_s: float = CONFIGURE_AFTER_S,
    ) -> None:
        self.tracing = tracing
        self._convert = convert
        self._configure_after_s = configure_after_s
        self._changed = threading.Condition()
        self._held: list[Record] = []
        self._due = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="lifecycle-spans", daemon=True)
        self._thread.start()

    def put(self, record: Record, *, due: bool = False) -> None:
        """Hold `record` for its span; `due`: configure the SDK now (the startup is over)."""
        with self._changed:
            if self._closing:
                return
            self._held.append(record)
            if due or self._due:
                self._due = True
                self._changed.notify()

    def close(self, *, within_s: float = FLUSH_WITHIN_S) -> None:
        """Make the held records into spans and send them, in at most `within_s` in all."""
        with self._changed:
            self._due = self._closing = True
            self._changed.notify()
        self.tracing.close(within_s=within_s, first=self._thread.join)

    def _run(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._due, timeout=self._configure_after_s)
            self._due = True
        if not self.tracing.configure():
            with self._changed:
                self._closing, self._held = True, []  # nothing will be sent: hold nothing
            return
        closing = False
        while not closing:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._held) or self._closing)
                held, self._held = self._held, []
                closing = self._closing
            for record in held:
                with contextlib.suppress(Exception):  # a span the trace lacks, not a failure
                    self._convert(record)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Sdk:
    provider: Any
    tracer: Any
    ids: _PresetIds


def _configure(*, service: str, timeout_s: float | None, unsent: _SayUnsent) -> _Sdk:
    """The SDK's tracer provider, exporting over OTLP/HTTP (the exporter reads the endpoint,
    headers and compression from the OTEL_* variables itself)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The exporter's own logging says each retry; the one warning line says it once.
    for name in ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk.trace.export"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    ids = _PresetIds()
    exporter = _WarnOnce(OTLPSpanExporter(timeout=timeout_s), unsent)
    # _PresetIds and _WarnOnce follow the SDK's interfaces without subclassing them, so that
    # this module imports the SDK only when it is configured.
    provider = TracerProvider(
        resource=Resource.create({"service.name": service}),
        id_generator=ids,  # type: ignore[arg-type]
        shutdown_on_exit=False,
    )
    provider.add_span_processor(
        BatchSpanProcessor(exporter, schedule_delay_millis=SCHEDULE_DELAY_MS)  # type: ignore[arg-type]
    )
    return _Sdk(provider=provider, tracer=provider.get_tracer("lifecycle"), ids=ids)


class _PresetIds:
    """Random ids, but for a span whose ids are derived from the run (set per thread)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

        self._random = RandomIdGenerator()
        self._local = threading.local()

    def preset(self, trace_id: int | None, span_id: int | None) -> None:
        self._local.trace_id, self._local.span_id = trace_id, span_id

    def generate_span_id(self) -> int:
        preset = getattr(self._local, "span_id", None)
        return int(preset) if preset else int(self._random.generate_span_id())

    def is_trace_id_random(self) -> bool:
        """Whether trace ids are random (W3C's random flag): not the run's, derived from its
        id."""
        return getattr(self._local, "trace_id", None) is None

    def generate_trace_id(self) -> int:
        preset = getattr(self._local, "trace_id", None)
        return int(preset) if preset else int(self._random.generate_trace_id())


class _SayUnsent:
    """Says once (one line) that spans did not reach the collector."""

    def __init__(self, endpoint: str, warn: Callable[[str], None]) -> None:
        self._endpoint = endpoint
        self._warn = warn
        self._lock = threading.Lock()
        self._said = False

    def failed(self, why: str) -> None:
        with self._lock:
            said, self._said = self._said, True
        if not said:
            self._warn(f"traces could not be sent to {self._endpoint} ({why[:200]})")


class _WarnOnce:
    """The OTLP exporter, saying once that the collector did not take the spans."""

    def __init__(self, exporter: Any, unsent: _SayUnsent) -> None:
        self._exporter = exporter
        self._unsent = unsent

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export(spans)
        except Exception as exc:  # instrumentation never raises into what it observes
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        else:
            why = "the collector did not accept them"
        if result is not SpanExportResult.SUCCESS:
            self._unsent.failed(why)
        return result

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._exporter.force_flush(timeout_millis))
