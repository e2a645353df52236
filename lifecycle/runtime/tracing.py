"""OpenTelemetry's SDK as the lifecycle uses it (`lifecycle[otel]`): configured once per process
from the standard `OTEL_*` variables, exporting over OTLP/HTTP, best effort (spans are queued
and sent by the SDK's own thread, a collector that is down or slow costs one warning line, and
the last spans get a bounded flush when the process ends, never more); and the run's trace id,
derived from the run id, so that every rank and node joins one trace without talking.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ATTRIBUTE_PREFIX = "lifecycle."
FLUSH_WITHIN_S = 2.0  # at a rank's end: what a collector that does not answer may cost it
EXPORT_TIMEOUT_S = 5.0  # one export's bound, unless OTEL_EXPORTER_OTLP_TIMEOUT says otherwise
EXTRA = "lifecycle[otel]"
PROTOCOLS = ("http/protobuf",)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportSettings:
    """Where spans go, as the OTEL_* variables say it (the exporter reads the rest itself)."""

    endpoint: str  # shown without credentials


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
        return None, f"OTLP protocol {protocol!r} is not supported (use http/protobuf)"
    return ExportSettings(endpoint=without_credentials(endpoint)), None


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


class Tracing:
    """The OpenTelemetry SDK of one process, configured once in an entry point."""

    def __init__(
        self, provider: Any, settings: ExportSettings, ids: Any, exporter: _WarnOnce
    ) -> None:
        self.provider = provider
        self.settings = settings
        self.tracer = provider.get_tracer("lifecycle")
        self._ids = ids
        self._exporter = exporter

    @classmethod
    def start(cls, env: Mapping[str, str], *, warn: Callable[[str], None]) -> Tracing | None:
        """The SDK, exporting to where the variables say; None when export is not asked for,
        or cannot be (one warning line: the extra not installed, another protocol)."""
        settings, refused = export_settings(env)
        if settings is None:
            if refused is not None:
                warn(f"traces are not exported: {refused}")
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            warn(f"traces are not exported: {exc.name} is not installed (pip install '{EXTRA}')")
            return None
        # The exporter's own logging says each retry; the one warning line below says it once.
        for name in ("opentelemetry.exporter.otlp.proto.http", "opentelemetry.sdk.trace.export"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        ids = _PresetIds()
        timeout = None if env.get("OTEL_EXPORTER_OTLP_TIMEOUT") else EXPORT_TIMEOUT_S
        exporter = _WarnOnce(OTLPSpanExporter(timeout=timeout), settings.endpoint, warn)
        resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "lifecycle")})
        # _PresetIds and _WarnOnce follow the SDK's interfaces without subclassing them, so that
        # this module imports the SDK only when export is asked for.
        provider = TracerProvider(
            resource=resource,
            id_generator=ids,  # type: ignore[arg-type]
            shutdown_on_exit=False,
        )
        processor = BatchSpanProcessor(exporter, schedule_delay_millis=500)  # type: ignore[arg-type]
        provider.add_span_processor(processor)
        return cls(provider, settings, ids, exporter)

    @contextlib.contextmanager
    def preset_ids(self, *, trace_id: int, span_id: int) -> Iterator[None]:
        """The next span this thread starts gets these ids (the run's root span)."""
        self._ids.preset(trace_id, span_id)
        try:
            yield
        finally:
            self._ids.preset(None, None)

    def close(self, *, within_s: float = FLUSH_WITHIN_S) -> None:
        """Send what is queued and stop, in at most `within_s`: a collector that does not
        answer never holds up the process's end."""
        done = threading.Thread(target=self._shutdown, name="lifecycle-otel-flush", daemon=True)
        done.start()
        done.join(within_s)
        if done.is_alive():
            self._exporter.failed(f"still sending after {within_s:.0f} s, left unsent")

    def _shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.provider.force_flush(timeout_millis=int(FLUSH_WITHIN_S * 1000))
            self.provider.shutdown()


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


class _WarnOnce:
    """The OTLP exporter, saying once (one line) that the collector did not take the spans."""

    def __init__(self, exporter: Any, endpoint: str, warn: Callable[[str], None]) -> None:
        self._exporter = exporter
        self._endpoint = endpoint
        self._warn = warn
        self._warned = False

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        try:
            result = self._exporter.export(spans)
        except Exception as exc:  # instrumentation never raises into what it observes
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        else:
            why = "the collector did not accept them"
        if result is not SpanExportResult.SUCCESS:
            self.failed(why)
        return result

    def failed(self, why: str) -> None:
        """Say once that spans did not reach the collector."""
        if not self._warned:
            self._warned = True
            self._warn(f"traces could not be sent to {self._endpoint} ({why[:200]})")

    def shutdown(self) -> None:
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._exporter.force_flush(timeout_millis))
