"""/metrics: the startup and serving of every rank in Prometheus's text format.

Three sources, one registry (prometheus_client):
- what the journal says, folded by the server as it follows it (`JournalMetrics`): each rank's
  state, time in each state, its launch, startup to ready from the launch, warmup requests by
  role, the probe's shape, collective timeouts, last heartbeat, requests served and failed,
  the residency plan, each rank's lag entering its requests' collectives;
- what the rank processes measure themselves (their journal appends and write errors), which
  they write to PROMETHEUS_MULTIPROC_DIR and MultiProcessCollector adds up;
- what the server measures itself: each /generate's duration, the requests in line, the
  build, and its own process (prometheus_client's process and platform collectors).
"""

from __future__ import annotations

import platform
import shutil
import tempfile
import threading
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from lifecycle import __version__
from lifecycle.core.command import installed_torch
from lifecycle.core.errors import ErrorKind
from lifecycle.core.format.accounting import account
from lifecycle.core.format.events import (
    Error,
    RequestFinished,
    ResidencyEvent,
    StoredEvent,
    WeightsPath,
)
from lifecycle.core.format.launchphase import launch_phase
from lifecycle.core.format.records import Role
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
LOST = "lost"  # the state lifecycle_rank_state gives a rank lost (its host gone, or stopped)
# From a micro model's request on a quiet machine (a tenth of a second) to a video model's at
# full size (minutes), as text-to-video serving spans them.
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# From ranks on one quiet host (a fraction of a millisecond of scheduling) to a rank whose
# device or link is several times slower than its peers' on a video model (seconds).
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(kw_only=True, eq=False)  # eq=False: a collector is registered by its identity
class JournalMetrics(Collector):
    """Metrics from the journal as the server follows it: `feed` every new event (for the
    counters), and `views` gives each rank's folded view (for the gauges) at scrape time; with
    what the server knows of each rank beside its journal: the ranks lost (`lost`) and the
    messages each dropped as not sealed with the run's store key (`rejected`)."""

    views: Callable[[], dict[int, RankView]]
    ended: Callable[[], set[int]]
    created_at: float
    hosts: Callable[[], dict[int, str]] = dict
    lost: Callable[[], set[int]] = set
    rejected: Callable[[], dict[tuple[int, str], int]] = dict
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _requests: Counter[tuple[int, str]] = field(default_factory=Counter, init=False)
    _timeouts: Counter[int] = field(default_factory=Counter, init=False)
    # (rank, index of the first LAG_BUCKETS bound the lag is within; len(LAG_BUCKETS): +Inf)
    _lag_counts: Counter[tuple[int, int]] = field(default_factory=Counter, init=False)
    _lag_sums: dict[int, float] = field(default_factory=dict, init=False)
    # rank: (plan, status)
    _residency: dict[int, tuple[str, str]] = field(default_factory=dict, init=False)
    # rank: (path, seconds, bytes) of its weights' latest attach or load (docs/keeper.md)
    _weights: dict[int, tuple[str, float, int]] = field(default_factory=dict, init=False)

    def feed(self, events: Iterable[StoredEvent]) -> None:
        with self._lock:
            for stored in events:
                event = stored.event
                if isinstance(event, RequestFinished):
                    self._requests[(stored.rank, "ok" if event.ok else "failed")] += 1
                    if event.lag_s is not None:
                        self._lag_counts[(stored.rank, bisect_left(LAG_BUCKETS, event.lag_s))] += 1
                        self._lag_sums[stored.rank] = (
                            self._lag_sums.get(stored.rank, 0.0) + event.lag_s
                        )
                elif isinstance(event, Error) and event.error_kind == ErrorKind.COLLECTIVE_TIMEOUT:
                    self._timeouts[stored.rank] += 1
                elif isinstance(event, ResidencyEvent):
                    status = event.kind.removeprefix("residency_").replace("_", "-")
                    self._residency[stored.rank] = (event.plan.plan_id, status)
                elif isinstance(event, WeightsPath):
                    self._weights[stored.rank] = (event.path, event.seconds, event.bytes)

    def collect(self) -> Iterator[Metric]:
        now = time.time()
        views = self.views()
        lost = self.lost()
        yield from _state_metrics(
            views, ended=self.ended() | lost, lost=lost, now=now, created_at=self.created_at
        )
        yield from _warmup_metrics(views)
        yield from _startup_metrics(views, now=now)
        with self._lock:
            requests = dict(self._requests)
            timeouts = dict(self._timeouts)
            residency = dict(self._residency)
            weights = dict(self._weights)
            lags = _lag_histogram(self._lag_counts, self._lag_sums)
        yield lags
        served = CounterMetricFamily(
            "lifecycle_requests",
            "Requests a rank finished after ready (smoke and /generate), by outcome.",
            labels=["rank", "outcome"],
        )
        for rank in sorted(views):
            for outcome in ("ok", "failed"):
                served.add_metric([str(rank), outcome], requests.get((rank, outcome), 0))
        yield served
        timed_out = CounterMetricFamily(
            "lifecycle_collective_timeouts",
            "Collectives that ran out the process-group timeout, by rank.",
            labels=["rank"],
        )
        for rank in sorted(views):
            timed_out.add_metric([str(rank)], timeouts.get(rank, 0))
        yield timed_out
        plan = GaugeMetricFamily(
            "lifecycle_residency_plan_info",
            "The residency plan a rank runs with, and how far it got (planned, applied,"
            " verified, rolled-back).",
            labels=["rank", "plan", "status"],
        )
        for rank, (plan_id, status) in sorted(residency.items()):
            plan.add_metric([str(rank), plan_id, status], 1)
        yield plan
        took = GaugeMetricFamily(
            "lifecycle_weights_seconds",
            "How long a rank's weights took to come in, by the path it took (attach from the"
            " host's keeper, or load from disk), at its latest startup or wake.",
            labels=["rank", "path"],
        )
        held = GaugeMetricFamily(
            "lifecycle_weights_bytes",
            "The bytes of a rank's weights, by the path they came in by.",
            labels=["rank", "path"],
        )
        for rank, (path, seconds, nbytes) in sorted(weights.items()):
            took.add_metric([str(rank), path], seconds)
            held.add_metric([str(rank), path], nbytes)
        yield took
        yield held
        placed = GaugeMetricFamily(
            "lifecycle_rank_info",
            "Each rank and the host it runs on (1), as the rank said at its start.",
            labels=["rank", "host"],
        )
        for rank, host in sorted(self.hosts().items()):
            placed.add_metric([str(rank), host], 1)
        yield placed
        dropped = CounterMetricFamily(
            "lifecycle_store_rejected",
            "Messages a rank read from the rendezvous store or the control group and dropped,"
            " as not sealed with the run's store key, by rank and channel.",
            labels=["rank", "channel"],
        )
        for (rank, channel), total in sorted(self.rejected().items()):
            dropped.add_metric([str(rank), channel], total)
        yield dropped


def _lag_histogram(counts: Counter[tuple[int, int]], sums: dict[int, float]) -> Metric:
    """Each rank's lags as a histogram: `counts` per (rank, bucket index), made cumulative
    here as Prometheus's `le` buckets are; a rank appears once it has a lag."""
    lag = HistogramMetricFamily(
        "lifecycle_rank_lag_seconds",
        "Each rank's lag entering a request's collectives against its peers: the median over"
        " the request (requests that ran on two ranks or more and finished ok).",
        labels=["rank"],
    )
    bounds = [floatToGoString(b) for b in LAG_BUCKETS] + ["+Inf"]  # type: ignore[no-untyped-call]
    for rank, total in sorted(sums.items()):
        within = accumulate(counts[(rank, i)] for i in range(len(bounds)))
        lag.add_metric([str(rank)], list(zip(bounds, within, strict=True)), total)
    return lag


def _state_metrics(
    views: dict[int, RankView], *, ended: set[int], lost: set[int], now: float, created_at: float
) -> Iterator[Metric]:
    state = GaugeMetricFamily(
        "lifecycle_rank_state",
        "1 for the state each rank is in, 0 for the others (`lost`: a rank the group went on"
        " without, whatever its journal last said).",
        labels=["rank", "state"],
    )
    seconds = GaugeMetricFamily(
        "lifecycle_state_seconds",
        "Seconds each rank spent in each state it entered (the current one so far).",
        labels=["rank", "state"],
    )
    ready = GaugeMetricFamily(
        "lifecycle_startup_to_ready_seconds",
        "Seconds from the launch to each rank entering ready.",
        labels=["rank"],
    )
    launched = GaugeMetricFamily(
        "lifecycle_launch_seconds",
        "Seconds from the launch (the launcher's process start) to each rank's first event:"
        " its process started, torch and the lifecycle imported.",
        labels=["rank"],
    )
    heartbeat = GaugeMetricFamily(
        "lifecycle_heartbeat_age_seconds",
        "Seconds since each rank's last heartbeat.",
        labels=["rank"],
    )
    beat = GaugeMetricFamily(
        "lifecycle_heartbeat_timestamp_seconds",
        "The wall time (Unix seconds) of each rank's last heartbeat.",
        labels=["rank"],
    )
    healthy = GaugeMetricFamily(
        "lifecycle_rank_healthy",
        "1 when a rank is ready, its ready action is done and its process is running.",
        labels=["rank"],
    )  # fmt: skip
    for rank, view in sorted(views.items()):
        label = str(rank)
        current = LOST if rank in lost else view.state
        for name in (*(s.value for s in State), LOST):
            state.add_metric([label, name], 1.0 if current == name else 0.0)
        for name, value in _seconds_in_states(view, now=now).items():
            seconds.add_metric([label, name], value)
        launch = launch_phase(view)
        if launch is not None:
            launched.add_metric([label], launch.launch_s)
        entered = view.entered_at(State.READY.value)
        if entered is not None:
            since = launch.launched_at if launch is not None else created_at
            ready.add_metric([label], entered - since)
        if view.last_heartbeat_wall is not None:
            heartbeat.add_metric([label], max(0.0, now - view.last_heartbeat_wall))
            beat.add_metric([label], view.last_heartbeat_wall)
        healthy.add_metric([label], 1.0 if view.healthy and rank not in ended else 0.0)
    yield from (state, seconds, launched, ready, heartbeat, beat, healthy)


def _seconds_in_states(view: RankView, *, now: float) -> dict[str, float]:
    """Seconds the rank spent in each state it entered, the current one up to `now`."""
    spent: dict[str, float] = {}
    for span in view.spans:
        spent[span.state] = spent.get(span.state, 0.0) + (span.duration_s(now=now) or 0.0)
    return spent


def _warmup_metrics(views: dict[int, RankView]) -> Iterator[Metric]:
    took = GaugeMetricFamily(
        "lifecycle_warmup_request_seconds",
        "Seconds of each rank's warmup requests, by role (bounded, probe, rewarm).",
        labels=["rank", "role"],
    )
    peak = GaugeMetricFamily(
        "lifecycle_warmup_peak_bytes",
        "The highest peak memory of each rank's warmup requests, by role.",
        labels=["rank", "role", "source"],
    )
    probe = GaugeMetricFamily(
        "lifecycle_probe_shape_info",
        "The probe's shape, as the ranks agreed it (1 per rank that planned one).",
        labels=["rank", "width", "height", "frames"],
    )
    for rank, view in sorted(views.items()):
        label = str(rank)
        by_role: dict[str, float] = {}
        peaks: dict[tuple[str, str], int] = {}
        for record in view.warmup_records:
            role = str(record.role)
            by_role[role] = by_role.get(role, 0.0) + record.total_s
            if record.peak_bytes is not None:
                key = (role, record.memory_source or "unknown")
                peaks[key] = max(peaks.get(key, 0), record.peak_bytes)
        for role, value in by_role.items():
            took.add_metric([label, role], value)
        for (role, source), value in peaks.items():
            peak.add_metric([label, role, source], float(value))
        planned = view.plan.requests if view.plan is not None else ()
        shape = next((r.shape for r in planned if r.role is Role.PROBE), None)
        if shape is not None:
            probe.add_metric([label, str(shape.width), str(shape.height), str(shape.frames)], 1)
    yield from (took, peak, probe)


def _startup_metrics(views: dict[int, RankView], *, now: float) -> Iterator[Metric]:
    phases = GaugeMetricFamily(
        "lifecycle_startup_phase_seconds",
        "Seconds of each phase of each rank's startup, from the launch to ready (so far, while"
        " it starts); `unattributed` is what no phase holds.",
        labels=["rank", "phase"],
    )
    loaded = GaugeMetricFamily(
        "lifecycle_component_load_bytes",
        "Bytes of each pipeline component each rank loaded (read from files, or built).",
        labels=["rank", "component"],
    )
    load_seconds = GaugeMetricFamily(
        "lifecycle_component_load_seconds",
        "Seconds each rank took to load each pipeline component, its move to the device"
        " included (so far, while it loads).",
        labels=["rank", "component"],
    )
    for rank, view in sorted(views.items()):
        kept = account(view, now=now)
        if kept is None:
            continue
        label = str(rank)
        spent: dict[str, float] = {}
        for phase in kept.phases:
            spent[phase.name] = spent.get(phase.name, 0.0) + phase.seconds
        for name, seconds in spent.items():
            phases.add_metric([label, name], seconds)
        phases.add_metric([label, "unattributed"], kept.unattributed_s)
        for load in kept.loads:
            loaded.add_metric([label, load.component], float(load.bytes))
            if load.seconds is not None:
                load_seconds.add_metric([label, load.component], load.seconds)
    yield from (phases, loaded, load_seconds)


class Metrics:
    """The registry /metrics renders, and the directory the rank processes write theirs to
    (made empty here, removed by `close`); the journal's metrics and the line's depth are
    added once the service that follows the journal exists."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="lifecycle-metrics-")
        # The `_created` series of counters and histograms are off, as most exporters ship:
        # a second series per metric that few dashboards read (this process's setting).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=self.directory)  # type: ignore[no-untyped-call]
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        Info(
            "lifecycle_build",
            "The lifecycle that serves, and the torch and Python it runs with.",
            registry=self.registry,
        ).info(
            {
                "version": __version__,
                "torch": installed_torch() or "none",
                "python": platform.python_version(),
            }
        )
        self.request_seconds = Histogram(
            "lifecycle_request_duration_seconds",
            "Seconds from a /generate's place in line to its reply, of the requests the ranks"
            " ran, by outcome (ok, failed).",
            ["outcome"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._queue = Gauge(
            "lifecycle_queue_depth",
            "/generate requests running or waiting for the ranks.",
            registry=self.registry,
        )

    def add(self, journal: JournalMetrics, *, queue_depth: Callable[[], int]) -> None:
        self.registry.register(journal)
        self._queue.set_function(queue_depth)

    def rank_env(self) -> dict[str, str]:
        """What a rank process's environment needs for its measurements to reach /metrics."""
        return {MULTIPROC_ENV: self.directory}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
