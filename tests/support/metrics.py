"""/metrics of a served lifecycle, parsed by prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.support.serving import Served


def scrape(served: Served) -> dict[str, list[Sample]]:
    """Every metric family /metrics answers (200, Prometheus text), by name."""
    response = served.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    return {f.name: f.samples for f in text_string_to_metric_families(response.text)}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    """The one sample `name` with `labels` among `samples`."""
    found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]
