"""Each rank's lag entering its requests' collectives, as `lifecycle serve` exports it:
`lifecycle_rank_lag_seconds` on /metrics, the straggler and gate-check's findings on
/lifecycle."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle.core.format.events import Event, RequestFinished, StoredEvent
from lifecycle.serve.http.metrics import JournalMetrics
from tests.support import T0, journal_events, scrape, serve, value

LAG = "lifecycle_rank_lag_seconds"
CAT = {"prompt": "a cat", "width": 256, "height": 144, "frames": 9, "steps": 2, "seed": 4}
REQUESTS = 5


def finished(rank: int, seq: int, *, lag_s: float | None, ok: bool = True) -> StoredEvent:
    """Rank `rank`'s request_finished, `lag_s` after its peers (None: no lag journaled)."""
    event: Event = RequestFinished(
        request_id=f"r{seq}", ok=ok, total_s=0.3, checksum=None, peak_bytes=None,
        lag_s=lag_s, lag_group="ulysses0" if lag_s is not None else "",
    )  # fmt: skip
    return StoredEvent(
        run_id="run", rank=rank, seq=seq, wall_time=T0 + seq, mono_ns=seq, state="ready",
        event=event,
    )  # fmt: skip


def test_the_lag_histogram_counts_each_lag_in_its_bucket_by_rank() -> None:
    """Each request_finished with a lag is one observation in its rank's series, in every
    bucket from the first bound at or above it (a lag past 5 s only in +Inf); one without a
    lag (one rank, the smoke request, a failed request) is none, and a rank with no lag has
    no series."""
    metrics = JournalMetrics(views=dict, ended=set, created_at=T0)
    registry = CollectorRegistry()
    registry.register(metrics)
    metrics.feed([
        finished(0, 1, lag_s=0.0), finished(0, 2, lag_s=0.0003),
        finished(1, 1, lag_s=0.012), finished(1, 2, lag_s=0.002), finished(1, 3, lag_s=7.0),
        finished(1, 4, lag_s=None), finished(1, 5, lag_s=None, ok=False),
        finished(2, 1, lag_s=None),
    ])  # fmt: skip
    (family,) = [
        f for f in text_string_to_metric_families(generate_latest(registry).decode())
        if f.name == LAG
    ]  # fmt: skip
    assert family.type == "histogram"
    samples = family.samples
    assert {s.labels["rank"] for s in samples} == {"0", "1"}
    buckets = {
        s.labels["le"]: s.value
        for s in samples
        if s.name == f"{LAG}_bucket" and s.labels["rank"] == "1"
    }  # fmt: skip
    assert (buckets["0.001"], buckets["0.002"], buckets["0.01"]) == (0, 1, 1)
    assert (buckets["0.025"], buckets["5.0"], buckets["+Inf"]) == (2, 2, 3)
    assert value(samples, f"{LAG}_count", rank="1") == 3
    assert value(samples, f"{LAG}_sum", rank="1") == pytest.approx(7.014)
    assert value(samples, f"{LAG}_bucket", rank="0", le="0.0005") == 2
    assert value(samples, f"{LAG}_sum", rank="0") == pytest.approx(0.0003)


@pytest.mark.ranks
@pytest.mark.usefixtures("no_leftover_processes")
def test_a_rank_slowed_from_ready_is_the_straggler_on_metrics_and_lifecycle(
    tmp_path: Path,
) -> None:
    """`--fault 1:ready:slow:10`: after five /generate, /metrics has a lag per request on each
    rank, rank 1's summing to more than rank 0's, and /lifecycle names rank 1 the straggler
    in ulysses0 with the sentence a person reads; the driver rank 1 says it has (a test hook)
    is gate-check's one environment finding there, a difference that does not matter."""
    fault = ("--num-ranks", "2", "--fault", "1:ready:slow:10")
    told = {"LIFECYCLE_TEST_RANK_ENVIRONMENT": "1:driver=999.99"}
    with serve(tmp_path, *fault, env=told) as served:
        served.wait_for_health(200, within=180)
        for _ in range(REQUESTS):
            reply = served.client.post("/generate", json=CAT)
            assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while True:  # the server folds the journal every 0.2 s
            lags = scrape(served).get(LAG, [])
            counts = [s.value for s in lags if s.name == f"{LAG}_count"]
            if counts == [REQUESTS, REQUESTS] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        state = served.client.get("/lifecycle").json()
        assert served.stop() == 0
    assert counts == [REQUESTS, REQUESTS], counts
    journaled = [
        e for e in journal_events(served.db)
        if isinstance(e.event, RequestFinished) and e.event.lag_s is not None
    ]  # fmt: skip
    assert [e.rank for e in journaled].count(1) == REQUESTS
    late, other = (value(lags, f"{LAG}_sum", rank=r) for r in "10")
    assert late > other, (late, other)
    straggler = state["straggler"]
    assert straggler is not None, f"rank 1's lag sum {late:.4f} s, rank 0's {other:.4f} s"
    assert (straggler["rank"], straggler["group"], straggler["requests"]) == (
        1, "ulysses0", REQUESTS
    )  # fmt: skip
    assert straggler["median_lag_s"] > straggler["next_lag_s"]
    assert straggler["text"].startswith("rank 1 enters ulysses0's collectives ")
    # gate-check's probes measure each rank's speed on this shared machine: under load a
    # rank can be measured slow (a `slow-rank` finding, a warning); the environment's
    # difference is the one finding the test put there
    codes = {found["code"] for found in state["rank_checks"]}
    assert codes <= {"environment", "slow-rank"}, state["rank_checks"]
    (found,) = [found for found in state["rank_checks"] if found["code"] == "environment"]
    assert {key: found[key] for key in ("code", "rank", "field", "value", "matters")} == {
        "code": "environment", "rank": 1, "field": "driver", "value": "999.99", "matters": False
    }  # fmt: skip
