"""The parts of the startup benchmarks (parallel-load, accounted, otel-export) that decide what
they measure: the size of the directory, the rows' shares, the journal copies and the OTLP
receivers standing in for a collector."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import time
from pathlib import Path

import pytest

from bench.accounted import FIRST, Case, _row
from bench.bootrun import Booted, RankStartup, copy_journal
from bench.loadside import UMT5_XXL_LAYERS, layers_that_fit
from bench.otlpreceiver import closed_port, otlp_receiver

GB = 10**9


def test_the_encoder_is_sized_down_to_what_memory_or_disk_holds() -> None:
    """The encoder gets as many layers as fit beside the files and one load, limited by the
    scarcer of memory and disk, never more than UMT5-XXL's, and a machine with room for none
    is refused."""
    sizes = {"upcast": GB, "encoder": (3 * GB, 4 * GB)}  # 1e9 per layer, 2e9 beside them
    # Files beside the layers: 2 * (1e9 + 2e9) = 6 GB; a load: 4 GB + the process's 1.5 GiB.
    by_memory, limit = layers_that_fit(memory_bytes=30 * GB, disk_bytes=100 * GB, **sizes)
    assert (by_memory, limit) == ((30 * GB - 6 * GB - 4 * GB - 3 * 2**29) // (2 * GB), "memory")
    assert layers_that_fit(memory_bytes=30 * GB, disk_bytes=12 * GB, **sizes) == (3, "disk")
    assert layers_that_fit(memory_bytes=10**12, disk_bytes=10**12, **sizes) == (
        UMT5_XXL_LAYERS,
        "UMT5-XXL",
    )
    with pytest.raises(ValueError, match="no room for an encoder layer"):
        layers_that_fit(memory_bytes=10 * GB, disk_bytes=100 * GB, **sizes)


def _booted(run_id: str, shares: list[tuple[float, float]]) -> Booted:
    path = ("created", "gate-check", "bounded-warm", "ready")
    ranks = []
    for rank, (total, unattributed) in enumerate(shares):
        phases = (("import torch", total / 2),)
        ranks.append(
            RankStartup(
                rank=rank, path=path, total_s=total, unattributed_s=unattributed, phases=phases
            )
        )
    return Booted(run_id=run_id, ranks=tuple(ranks), stderr="", wall_s=1.0)


def test_an_accounted_row_takes_the_largest_rank_share_and_its_median_over_rounds() -> None:
    """Each round counts the rank with the largest unattributed share; the row shows the
    median of those over the rounds against the 2 % target."""
    boots = [
        _booted("a", [(10.0, 0.1), (10.0, 0.3)]),  # 3 %: rank 1
        _booted("b", [(10.0, 0.1), (10.0, 0.05)]),  # 1 %: rank 0
        _booted("c", [(10.0, 0.4), (10.0, 0.0)]),  # 4 %: rank 0
    ]
    row = _row(Case(model="micro-video", ranks=2), FIRST, boots, rounds=3)
    assert row.ratio == "3.00%"
    assert row.target == "<= 2%: MISSED"
    assert row.value == "300.00 ms unattributed"
    assert row.baseline == "10.00 s to ready"
    assert "micro-video, 2 ranks, first boot (bounded path)" in row.figure
    met = _row(Case(model="micro-video", ranks=2), FIRST, boots[1:2], rounds=1)
    assert met.target == "<= 2%: met"


def test_a_journal_copy_holds_what_its_write_ahead_log_held(tmp_path: Path) -> None:
    """A journal copied while its last writes are still in its write-ahead log holds them."""
    source, target = tmp_path / "j.db", tmp_path / "copy.db"
    with contextlib.closing(sqlite3.connect(source)) as db:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA wal_autocheckpoint=0")
        db.execute("CREATE TABLE runs (run_id TEXT)")
        db.execute("INSERT INTO runs VALUES ('r1')")
        db.commit()
        assert Path(f"{source}-wal").stat().st_size > 0
        copy_journal(source, target)
    with contextlib.closing(sqlite3.connect(target)) as db:
        assert db.execute("SELECT run_id FROM runs").fetchall() == [("r1",)]


def _export_one_span(endpoint: str) -> tuple[str, float]:
    """One span sent by OpenTelemetry's own OTLP/HTTP exporter; its trace id and how long the
    export took."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces", timeout=10))
    )
    started = time.perf_counter()
    with provider.get_tracer("bench-test").start_as_current_span("one") as span:
        trace_id = f"{span.get_span_context().trace_id:032x}"
    seconds = time.perf_counter() - started
    provider.shutdown()
    return trace_id, seconds


@pytest.mark.timeout(60)
def test_the_receivers_count_an_exporters_spans_and_the_slow_one_answers_late() -> None:
    """A live receiver counts the spans an OTLP exporter posts, by trace; a slow one answers
    each export only after its delay; a closed port refuses connections."""
    with otlp_receiver() as live, otlp_receiver(delay_s=0.5) as slow:
        trace_id, _ = _export_one_span(live.endpoint)
        assert live.spans_of(trace_id, within_s=10.0) == 1
        assert live.posts == 1
        slow_trace, seconds = _export_one_span(slow.endpoint)
        assert seconds >= 0.5
        assert slow.spans_of(slow_trace, within_s=10.0) == 1
        assert live.spans_of(slow_trace, within_s=0.0) == 0
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock,
        pytest.raises(ConnectionRefusedError),
    ):
        sock.connect(("127.0.0.1", closed_port()))
