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
from collections.abc import Callable, Iterator
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
def export_server(answer: Callable[[str, bytes, float], int]) -> Iterator[int]:
    """An HTTP server on a free loopback port while it is entered (the port yielded): each POST
    is answered, with an empty protobuf body, by the status `answer` returns for its path, its
    body (un-gzipped) and when it arrived (wall time)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            arrived = time.time()
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            self.send_response(answer(self.path, body, arrived))
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def otlp_receiver(*, delay_s: float = 0.0) -> Iterator[Receiver]:
    """A receiver on a free loopback port while it is entered, answering each export after
    `delay_s`."""
    holder: list[Receiver] = []

    def answer(path: str, body: bytes, _arrived: float) -> int:
        receiver = holder[0]
        if receiver.delay_s:
            time.sleep(receiver.delay_s)
        if path != TRACES_PATH:
            return 404
        found = trace_ids(body)
        with receiver.lock:
            receiver.posts += 1
            receiver.spans.update(found)
        return 200

    with export_server(answer) as port:
        holder.append(Receiver(port=port, delay_s=delay_s))
        yield holder[0]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): a collector that is down."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port
