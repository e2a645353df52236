"""What sending the startup as traces costs a rank, against a real OTLP/HTTP receiver (or a
collector that is down or never answers): nothing is sent, nor the SDK imported, before the
startup is ready; a startup still going after a while sends its spans while it runs, with the
times they happened; and a process's end waits on a collector in trouble for the bounded flush
only, saying so in one warning line."""

from __future__ import annotations

import contextlib
import os
import socket
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import lifecycle.runtime.telemetry.rankspans
from lifecycle.core.format import events as ev
from lifecycle.core.format.records import PhaseTime
from lifecycle.runtime.telemetry.rankspans import RankSpans
from lifecycle.runtime.telemetry.tracing import FLUSH_WITHIN_S, Tracing
from lifecycle.store.journal import Journal
from tests.conftest import REPO, Completed
from tests.otlp import Receiver, otel_env
from tests.support.interpreter import run_python

pytest.importorskip("opentelemetry.sdk")

MICRO = ("boot", "--model", "micro-video", "--db", "j.db")
# From a rank's last journaled event to its boot's exit, export off: the rank leaves its group
# and exits, the launcher reaps it and prints its summary. That took 0.08 to 0.15 s on a shared
# 2-core machine under a load of 6 to 16; the margin is several times that.
EXIT_MARGIN_S = 1.0
LOOKED_INTO = ("opentelemetry", "opentelemetry.exporter", "opentelemetry.exporter.otlp",
               "opentelemetry.exporter.otlp.proto")  # fmt: skip


def journaled(db: Path) -> list[ev.StoredEvent]:
    """Every event of the journal's one run."""
    with contextlib.closing(Journal.open_for_read(str(db))) as journal:
        (run,) = journal.runs()
        return list(journal.read(run_id=run.run_id))


def ready_wall(events: list[ev.StoredEvent]) -> float:
    """When the rank's startup was ready: its ready action done."""
    (ready,) = [
        e.wall_time
        for e in events
        if isinstance(e.event, ev.ActionFinished) and e.event.action == "mark-ready"
    ]
    return ready


@contextlib.contextmanager
def silent_collector() -> Iterator[str]:
    """A collector that takes every connection and never answers on any: its endpoint."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    taken: list[socket.socket] = []
    done = threading.Event()

    def take() -> None:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                taken.append(server.accept()[0])

    thread = threading.Thread(target=take, name="silent-collector", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        done.set()
        thread.join(5.0)
        for connection in taken:
            connection.close()
        server.close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_nothing_is_sent_before_the_startup_is_ready(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A boot with a live collector: its first export reaches the collector only after the
    rank's ready action is done, and holds the whole startup (the rank's span, its states,
    actions, loads and phases)."""
    booted = lifecycle_cli(*MICRO, env=otel_env(receiver.endpoint))
    assert booted.returncode == 0, booted.stderr[-2000:]
    receiver.wait_for(1, name="lifecycle.run")
    ready = ready_wall(journaled(tmp_path / "j.db"))
    assert receiver.arrivals and min(receiver.arrivals) > ready
    names = {span.name for span in receiver.spans}
    assert {"lifecycle.rank", "lifecycle.state gate-check", "lifecycle.action load-pipeline",
            "lifecycle.load dit", "lifecycle.phase import torch"} <= names  # fmt: skip


def test_holding_a_startups_events_imports_nothing_of_opentelemetry(
    tmp_path: Path, receiver: Receiver
) -> None:
    """A rank's spans, before its startup is over: the events recorded are held, and no part
    of OpenTelemetry is imported yet (its import is paid after ready)."""
    script = textwrap.dedent(
        """
        import os, sys, time
        from lifecycle.core.format import events as ev
        from lifecycle.runtime.telemetry.rankspans import RankSpans
        from lifecycle.runtime.telemetry.tracing import Tracing

        tracing = Tracing.deferred(os.environ, warn=print)
        spans = RankSpans(tracing, run_id="r1", rank=0, attributes={"model": "m"})
        recorded = [
            ev.Transition(trigger="start", source="created", dest="gate-check"),
            ev.ActionStarted(action="load-pipeline"),
            ev.ActionFinished(action="load-pipeline", duration_s=0.5, ok=True),
        ]
        for seq, event in enumerate(recorded):
            spans(ev.StoredEvent(run_id="r1", rank=0, seq=seq, wall_time=time.time(),
                                 mono_ns=time.monotonic_ns(), state="gate-check", event=event))
        print(" ".join(m for m in sys.modules if m.startswith(("opentelemetry", "google"))))
        """
    )
    done = run_python(
        script, cwd=tmp_path, env={"PYTHONPATH": str(REPO), **otel_env(receiver.endpoint)},
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    imported = set(done.stdout.strip().splitlines()[-1].split())
    # Only the packages that finding the SDK (not importing it) looks into.
    assert imported <= set(LOOKED_INTO), imported
    assert receiver.posts == 0


def stored(event: ev.Event, *, seq: int, wall: float) -> ev.StoredEvent:
    return ev.StoredEvent(
        run_id="long-run", rank=0, seq=seq, wall_time=wall, mono_ns=0, state="created",
        event=event,
    )  # fmt: skip


def test_a_long_startup_sends_its_spans_while_it_runs(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A startup still going once the feed's wait is over: its ended spans reach the collector
    before it is ready, with the times their events carry; nothing is sent before the wait."""
    monkeypatch.setattr(lifecycle.runtime.telemetry.rankspans, "_CURRENT", [None])
    for name, value in otel_env(receiver.endpoint).items():
        monkeypatch.setenv(name, value)
    tracing = Tracing.deferred(os.environ, warn=lambda text: None)
    assert tracing is not None
    spans = RankSpans(
        tracing, run_id="long-run", rank=0, attributes={"model": "m"}, configure_after_s=1.0
    )
    started = time.time() - 10.0
    try:
        spans(stored(ev.RunStarted(
            world_size=1, host="h", pid=1, lifecycle_version="0", torch_version=None,
            python_version="3", device="cpu", dist_backend=None, process_started_wall=started,
            phases=(PhaseTime(name="import torch", seconds=4.0),),
        ), seq=0, wall=started + 5.0))  # fmt: skip
        spans(stored(ev.Transition(trigger="start", source="created", dest="gate-check"),
                     seq=1, wall=started + 6.0))  # fmt: skip
        assert receiver.posts == 0
        receiver.wait_for(1, name="lifecycle.state created", within_s=30.0)
    finally:
        spans.close()
    (phase,) = [s for s in receiver.spans if s.name == "lifecycle.phase import torch"]
    assert phase.start_s == pytest.approx(started, abs=1e-3)
    assert phase.end_s == pytest.approx(started + 4.0, abs=1e-3)
    (created,) = [s for s in receiver.spans if s.name == "lifecycle.state created"]
    assert created.end_s == pytest.approx(started + 6.0, abs=1e-3)


@pytest.mark.parametrize("collector", ["down", "silent"])
def test_a_collector_in_trouble_holds_the_exit_for_the_bounded_flush_only(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], collector: str
) -> None:
    """A boot whose collector is down (a closed port) or never answers (a socket that takes
    connections and says nothing): it exits 0 within the bounded flush (plus the launcher's own
    end) of its rank's last journaled event, and says so in one warning line."""
    with silent_collector() as silent:
        endpoint = silent if collector == "silent" else f"http://127.0.0.1:{closed_port()}"
        booted = lifecycle_cli(*MICRO, env=otel_env(endpoint))
        exited = time.time()
    assert booted.returncode == 0, booted.stderr[-2000:]
    last = max(e.wall_time for e in journaled(tmp_path / "j.db"))
    assert exited - last <= FLUSH_WITHIN_S + EXIT_MARGIN_S
    (warning,) = [line for line in booted.stderr.splitlines() if "traces" in line]
    assert "traces could not be sent to http://127.0.0.1:" in warning


def test_the_http_fronts_sdk_is_configured_once_every_rank_is_ready_and_never_after_a_failure(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve`'s front imports and configures its SDK in a thread of its own once the ranks
    are ready, not while they start; a server that failed or stopped first never does."""
    from lifecycle.serve.http.httpspans import configure_once_ready

    for name, value in otel_env(receiver.endpoint).items():
        monkeypatch.setenv(name, value)
    waiting, failing = (
        Tracing.deferred(os.environ, warn=print),
        Tracing.deferred(os.environ, warn=print),
    )
    assert waiting is not None and failing is not None
    ready, over = threading.Event(), threading.Event()
    started = configure_once_ready(waiting, ready=ready.is_set, over=lambda: False, poll_s=0.01)
    given_up = configure_once_ready(failing, ready=lambda: False, over=over.is_set, poll_s=0.01)
    try:
        time.sleep(0.2)  # the threads poll twenty times meanwhile
        assert not waiting.configured and not failing.configured
        over.set()
        given_up.join(timeout=5)
        assert not given_up.is_alive() and not failing.configured
        ready.set()
        started.join(timeout=30)
        assert not started.is_alive() and waiting.configured
    finally:
        waiting.close()
        failing.close()


def test_a_long_endpoint_is_cut_in_the_warning_that_echoes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 100 KB `OTEL_EXPORTER_OTLP_ENDPOINT` whose collector is down is echoed in its one
    warning line cut to its first 200 characters and an ellipsis, not whole."""
    endpoint = f"http://127.0.0.1:{closed_port()}/" + "v" * 100_000
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    said: list[str] = []
    tracing = Tracing.start(os.environ, warn=said.append)
    assert tracing is not None
    tracing.tracer.start_span("lifecycle.test").end()
    tracing.close(within_s=5.0)
    (warning,) = said
    assert warning.startswith(f"traces could not be sent to {endpoint[:199]}…"), warning[:400]
    assert len(warning) < 600
