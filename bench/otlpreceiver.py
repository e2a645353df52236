"""An OTLP/HTTP trace receiver on 127.0.0.1 for bench.otelexport: it takes what an OpenTelemetry
exporter posts to /v1/traces (protobuf, gzip or not), decodes it with opentelemetry-proto and
counts the spans of each trace; told to, it sleeps before each answer, as a slow collector."""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TRACES_PATH = "/v1/traces"


@dataclass
class Receiver:
    port: int
    delay_s: float = 0.0
    posts: int = 0
    spans: Counter[str] = field(default_factory=Counter)  # by trace id, as hex
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans_of(self, trace_id: str, *, within_s: float) -> int:
        """The spans of the trace received once at least one has come, or 0 after
        `within_s`."""
        deadline = time.monotonic() + within_s
        while True:
            with self.lock:
                count = self.spans[trace_id]
            if count or time.monotonic() >= deadline:
                return count
            time.sleep(0.05)


def trace_ids(body: bytes) -> list[str]:
    """The trace id of every span an ExportTraceServiceRequest holds, as hex."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return [
        span.trace_id.hex()
        for resource_spans in request.resource_spans
        for scope in resource_spans.scope_spans
        for span in scope.spans
    ]


@contextlib.contextmanager
def otlp_receiver(*, delay_s: float = 0.0) -> Iterator[Receiver]:
    """A receiver on a free loopback port while it is entered, answering each export after
    `delay_s`."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            receiver = holder[0]
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if receiver.delay_s:
                time.sleep(receiver.delay_s)
            if self.path == TRACES_PATH:
                found = trace_ids(body)
                with receiver.lock:
                    receiver.posts += 1
                    receiver.spans.update(found)
            self.send_response(200 if self.path == TRACES_PATH else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    holder.append(Receiver(port=server.server_address[1], delay_s=delay_s))
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a collector that is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
