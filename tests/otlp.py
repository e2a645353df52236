"""A real OTLP/HTTP receiver on 127.0.0.1 for the tests: it takes what an OpenTelemetry exporter
posts to /v1/traces (protobuf, gzip or not), decodes it with opentelemetry-proto, and keeps
every span; it can also be told to answer slowly or with an error, as a collector in trouble."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from bench.otlpreceiver import TRACES_PATH, export_server


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    start_s: float
    end_s: float
    attributes: dict[str, Any]
    events: tuple[tuple[str, dict[str, Any]], ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    service: str


@dataclass
class Receiver:
    port: int
    spans: list[ReceivedSpan] = field(default_factory=list)
    posts: int = 0
    arrivals: list[float] = field(default_factory=list)  # each export's arrival, wall time
    delay_s: float = 0.0
    status: int = 200
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_for(self, count: int, *, within_s: float = 30.0, name: str | None = None) -> None:
        """Until `count` spans (named `name`, if given) have arrived, bounded."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            with self.lock:
                got = [s for s in self.spans if name is None or s.name == name]
            if len(got) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"{len(got)} of {count} spans arrived within {within_s} s")


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind is None:
        return None
    value = getattr(any_value, kind)
    if kind == "array_value":
        return [_value(v) for v in value.values]
    return value


def _attributes(items: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in items}


def decode(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope in resource_spans.scope_spans:
            for span in scope.spans:
                found.append(
                    ReceivedSpan(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        start_s=span.start_time_unix_nano / 1e9,
                        end_s=span.end_time_unix_nano / 1e9,
                        attributes=_attributes(span.attributes),
                        events=tuple((e.name, _attributes(e.attributes)) for e in span.events),
                        status_code=int(span.status.code),
                        service=service,
                    )
                )
    return found


def otel_env(endpoint: str) -> dict[str, str]:
    """The OTEL_* variables that send a process's traces to `endpoint`, as lifecycle-test."""
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "lifecycle-test"}


@contextmanager
def otlp_receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP trace receiver on a free loopback port, for the test's duration."""
    holder: list[Receiver] = []

    def answer(path: str, body: bytes, arrived: float) -> int:
        receiver = holder[0]
        with receiver.lock:
            receiver.arrivals.append(arrived)
        if receiver.delay_s:
            time.sleep(receiver.delay_s)
        if path == TRACES_PATH and receiver.status == 200:
            spans = decode(body)
            with receiver.lock:
                receiver.spans.extend(spans)
                receiver.posts += 1
        return receiver.status if path == TRACES_PATH else 404

    with export_server(answer) as port:
        holder.append(Receiver(port=port))
        yield holder[0]
