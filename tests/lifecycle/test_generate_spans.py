"""Each /generate as a SERVER span of the run's trace, received by a real OTLP/HTTP receiver and
decoded with opentelemetry-proto: joined to the client's trace when it sends a `traceparent`,
else to the run's; every rank's span of the request is its child; a refusal and a request cut
short past its deadline are errors; no span carries the prompt or a credential."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tests.otlp
from lifecycle.runtime.telemetry.tracing import run_span_id_of, trace_id_of
from tests.otlp import ReceivedSpan, Receiver, otlp_receiver
from tests.plugins import ENV
from tests.support import BUDGET, OVER, SLOW, SMALL, serve

pytest.importorskip("opentelemetry.sdk")

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SECRET_PROMPT = "a zebra-7c1e9 crossing a river"
PASSWORD = "hunter2-9d4f"
SERVER_KIND = 2  # SPAN_KIND_SERVER in OTLP


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Receiver, dict[str, int]]]:
    """The test receiver, noting each span's kind (by span id) beside what it keeps."""
    kinds: dict[str, int] = {}
    decode = tests.otlp.decode

    def decode_noting_kinds(body: bytes) -> list[ReceivedSpan]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    kinds[span.span_id.hex()] = int(span.kind)
        return decode(body)

    monkeypatch.setattr(tests.otlp, "decode", decode_noting_kinds)
    with otlp_receiver() as found:
        yield found, kinds


def strings(span: ReceivedSpan) -> str:
    """Everything a span carries, as text."""
    return repr((span.name, span.attributes, span.events))


def one(spans: list[ReceivedSpan], name: str, request_id: str) -> list[ReceivedSpan]:
    return [
        s
        for s in spans
        if s.name == name and s.attributes.get("lifecycle.request_id") == request_id
    ]


@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_generate_is_a_server_span_that_the_ranks_request_spans_join(
    tmp_path: Path, receiver: tuple[Receiver, dict[str, int]], ranks: int
) -> None:
    """With traces sent: a /generate with a client's traceparent is a SERVER span under the
    client's span, carrying the HTTP method, path, status and request id; one without is under
    the run's root span; the X-Request-ID header is an attribute only when the client sent it;
    each rank's request span is a child of the server span; a request refused by memory (422)
    and one cancelled past its deadline (504) have an error status and reach no rank span of
    their own beyond the cancelled one's; no span holds the prompt or the client's password."""
    received, kinds = receiver
    env = {**ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": received.endpoint, "OTEL_SERVICE_NAME": "front"}
    extra = ("--pipeline", "tests.plugins:SLOWING", "--model", "slow-video")
    extra = (*extra, "--num-ranks", str(ranks), "--memory-budget", BUDGET)
    with serve(tmp_path, *extra, env=env) as served:
        served.wait_for_health(200, within=180)
        client = served.client
        traced = client.post(
            "/generate",
            json={**SMALL, "prompt": SECRET_PROMPT},
            headers={
                "X-Request-ID": "traced-1",
                "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
            },
            auth=("operator", PASSWORD),
        )
        assert traced.status_code == 200, traced.text[:300]
        untraced = client.post("/generate", json=SMALL, headers={"X-Request-ID": "untraced-1"})
        assert untraced.status_code == 200, untraced.text[:300]
        anonymous = client.post("/generate", json=SMALL)
        assert anonymous.status_code == 200, anonymous.text[:300]
        anonymous_id = anonymous.headers["X-Request-ID"]
        refused = client.post("/generate", json=OVER, headers={"X-Request-ID": "refused-1"})
        assert refused.status_code == 422, refused.text[:300]
        cancelled = client.post("/generate", json=SLOW, headers={"X-Request-ID": "slow-1"})
        assert cancelled.status_code == 504, cancelled.text[:300]
        assert served.stop() == 0
    run_id = (tmp_path / "serve.log").read_text().split()[1]
    received.wait_for(5, name="POST /generate")
    received.wait_for(4 * ranks, name="lifecycle.request")
    spans = list(received.spans)

    (front,) = one(spans, "POST /generate", "traced-1")
    assert kinds[front.span_id] == SERVER_KIND
    assert (front.trace_id, front.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    attributes: dict[str, Any] = front.attributes
    assert attributes["http.request.method"] == "POST"
    assert attributes["url.path"] == "/generate"
    assert attributes["http.response.status_code"] == 200
    assert attributes["http.request.header.x-request-id"] == ["traced-1"]
    assert front.status_code == 0 and front.service == "front"
    joined = one(spans, "lifecycle.request", "traced-1")
    assert sorted(s.attributes["lifecycle.rank"] for s in joined) == list(range(ranks))
    assert all((s.trace_id, s.parent_span_id) == (CLIENT_TRACE, front.span_id) for s in joined)

    (alone,) = one(spans, "POST /generate", "untraced-1")
    assert alone.trace_id == f"{trace_id_of(run_id):032x}"
    assert alone.parent_span_id == f"{run_span_id_of(run_id):016x}"
    under = one(spans, "lifecycle.request", "untraced-1")
    assert len(under) == ranks and all(s.parent_span_id == alone.span_id for s in under)

    (unnamed,) = one(spans, "POST /generate", anonymous_id)
    assert "http.request.header.x-request-id" not in unnamed.attributes  # the client sent none

    (refusal,) = one(spans, "POST /generate", "refused-1")
    assert refusal.status_code == 2 and refusal.attributes["http.response.status_code"] == 422
    assert one(spans, "lifecycle.request", "refused-1") == []
    (late,) = one(spans, "POST /generate", "slow-1")
    assert late.status_code == 2 and late.attributes["http.response.status_code"] == 504
    stopped = one(spans, "lifecycle.request", "slow-1")
    assert len(stopped) == ranks and all(s.status_code == 2 for s in stopped)
    assert all(s.parent_span_id == late.span_id for s in stopped)

    for span in spans:
        assert "zebra-7c1e9" not in strings(span) and PASSWORD not in strings(span)
