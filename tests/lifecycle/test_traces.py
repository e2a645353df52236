"""The startup as OpenTelemetry traces, received by a real OTLP/HTTP receiver started here and
decoded with opentelemetry-proto: one trace per run that every rank joins, a span per rank,
state, action, phase, load and warmup request, errors as span events; a collector that is down
or slow costs a warning line and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.runtime.telemetry.tracing import run_span_id_of, trace_id_of
from tests.conftest import Completed
from tests.otlp import ReceivedSpan, Receiver, otel_env

pytest.importorskip("opentelemetry.sdk")

MICRO = ("boot", "--model", "micro-video", "--db", "j.db")


def run_id_of(booted: Completed) -> str:
    return booted.stdout.splitlines()[0].split()[1]


def by_name(spans: list[ReceivedSpan], prefix: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def test_two_ranks_send_one_trace_with_every_step_of_their_startup(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A 2-rank boot: every span in one trace whose id comes from the run id; rank 0's root
    span, each rank's span under it, their states, actions, phases, loads and warmup requests
    under those, each with the run, rank, host, model and fingerprint."""
    booted = lifecycle_cli(*MICRO, "--num-ranks", "2", env=otel_env(receiver.endpoint))
    assert booted.returncode == 0, booted.stderr[-2000:]
    assert "traces" not in booted.stderr  # no warning: the collector took them
    receiver.wait_for(2, name="lifecycle.rank")
    receiver.wait_for(1, name="lifecycle.run")
    spans = list(receiver.spans)
    run_id = run_id_of(booted)
    assert {s.trace_id for s in spans} == {f"{trace_id_of(run_id):032x}"}
    assert {s.service for s in spans} == {"lifecycle-test"}
    (root,) = by_name(spans, "lifecycle.run")
    assert root.parent_span_id == "" and root.span_id == f"{run_span_id_of(run_id):016x}"
    assert root.attributes["lifecycle.outcome"] == "ready"
    ranks = {s.attributes["lifecycle.rank"]: s for s in by_name(spans, "lifecycle.rank")}
    assert sorted(ranks) == [0, 1]
    for rank, span in ranks.items():
        assert span.parent_span_id == root.span_id
        assert span.attributes["lifecycle.run_id"] == run_id
        assert span.attributes["lifecycle.model"] == "micro-video"
        assert span.attributes["host.name"] and span.attributes["lifecycle.fingerprint"]
        mine = [s for s in spans if s.attributes.get("lifecycle.rank") == rank]
        states = {
            s.name: s for s in by_name(mine, "lifecycle.state ") if s.parent_span_id == span.span_id
        }
        assert set(states) >= {"lifecycle.state created", "lifecycle.state gate-check",
                               "lifecycle.state bounded-warm", "lifecycle.state ready"}  # fmt: skip
        phases = {s.name for s in by_name(mine, "lifecycle.phase ")}
        assert {"lifecycle.phase import torch", "lifecycle.phase spawn"} <= phases
        (load_pipeline,) = by_name(mine, "lifecycle.action load-pipeline")
        assert load_pipeline.parent_span_id == states["lifecycle.state gate-check"].span_id
        loads = by_name(mine, "lifecycle.load ")
        assert {s.name for s in loads} == {"lifecycle.load text_encoder", "lifecycle.load dit",
                                           "lifecycle.load vae"}  # fmt: skip
        assert all(s.parent_span_id == load_pipeline.span_id for s in loads)
        (bounded,) = by_name(mine, "lifecycle.warmup bounded")
        assert bounded.attributes["lifecycle.steps"] > 0
        assert all(s.start_s <= s.end_s for s in mine)


def test_a_failure_is_an_error_event_on_its_span(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A rank that raises in bounded-warm: the action's span carries the exception as an event
    with an error status, and the rank's and the run's spans say the startup failed."""
    booted = lifecycle_cli(
        *MICRO, "--fault", "0:bounded-warm:raise", env=otel_env(receiver.endpoint)
    )
    assert booted.returncode == 1, booted.stderr[-2000:]
    receiver.wait_for(1, name="lifecycle.run")
    spans = list(receiver.spans)
    failed = [s for s in spans if any(name == "exception" for name, _ in s.events)]
    assert failed and failed[0].status_code == 2
    (_, exception) = next(e for e in failed[0].events if e[0] == "exception")
    assert exception["exception.type"] == "InjectedFault"
    (rank,) = by_name(spans, "lifecycle.rank")
    (root,) = by_name(spans, "lifecycle.run")
    assert rank.status_code == root.status_code == 2
    assert rank.attributes["lifecycle.outcome"] == "failed"


@pytest.mark.parametrize(
    "collector",
    [
        "down",
        pytest.param("slow", marks=pytest.mark.slow),
        pytest.param("refusing", marks=pytest.mark.slow),
    ],
)
def test_a_collector_in_trouble_costs_one_warning_line(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed], collector: str
) -> None:
    """A collector that is not there, answers after 30 s or refuses every export: the boot
    gets to ready and exits 0, says so in one warning line at most, never with the endpoint's
    password."""
    if collector == "slow":
        receiver.delay_s = 30.0
    if collector == "refusing":
        receiver.status = 503
    endpoint = f"http://user:hunter2@127.0.0.1:{receiver.port if collector != 'down' else 9}"
    booted = lifecycle_cli(*MICRO, env=otel_env(endpoint))
    assert booted.returncode == 0, booted.stderr[-2000:]
    warnings = [line for line in booted.stderr.splitlines() if "traces" in line]
    assert len(warnings) <= 1, warnings
    if collector != "slow":
        assert len(warnings) == 1 and "could not be sent to http://127.0.0.1:" in warnings[0]
    assert "hunter2" not in booted.stdout + booted.stderr
    assert "startup to ready" in booted.stdout


def test_an_unsupported_protocol_is_one_warning_and_no_export(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed]
) -> None:
    """OTLP over gRPC is not what this lifecycle sends: one line says so, the boot goes on."""
    env = {**otel_env(receiver.endpoint), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    booted = lifecycle_cli(*MICRO, env=env)
    assert booted.returncode == 0, booted.stderr[-2000:]
    (warning,) = [line for line in booted.stderr.splitlines() if "traces" in line]
    assert "OTLP protocol 'grpc' is not supported (use http/protobuf)" in warning
    assert receiver.posts == 0


def test_without_the_extra_is_one_warning_and_no_export(
    tmp_path: Path, receiver: Receiver, lifecycle_cli: Callable[..., Completed]
) -> None:
    """An endpoint set where the SDK is not installed (a bare `opentelemetry` package shadows
    it): one line says what to install, the boot gets to ready and exits 0, nothing is sent."""
    bare = tmp_path / "bare" / "opentelemetry"
    bare.mkdir(parents=True)
    (bare / "__init__.py").write_text("")
    env = {**otel_env(receiver.endpoint), "PYTHONPATH": str(bare.parent)}
    booted = lifecycle_cli(*MICRO, env=env)
    assert booted.returncode == 0, booted.stderr[-2000:]
    (warning,) = [line for line in booted.stderr.splitlines() if "traces" in line]
    assert warning.endswith(
        "traces are not exported: opentelemetry.sdk is not installed"
        " (pip install 'diffusion-lifecycle[otel]')"
    )
    assert receiver.posts == 0


def test_export_is_on_only_where_the_standard_variables_say() -> None:
    """No endpoint, or the SDK disabled: no export; an endpoint is shown without its
    credentials or query."""
    from lifecycle.runtime.telemetry.tracing import export_settings

    assert export_settings({}) == (None, None)
    assert export_settings(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"}
    ) == (None, None)
    settings, refused = export_settings(
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://a:b@h:4318/v1/traces?x=1"}
    )
    assert refused is None and settings is not None
    assert settings.endpoint == "http://h:4318/v1/traces"
