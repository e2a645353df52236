"""The startup sent as OpenTelemetry traces: startup to ready of `lifecycle boot` with the OTLP
export on (a live OTLP/HTTP receiver the benchmark runs) against off (no OTEL_* variable), and
with a collector that is down (a closed port) or slow (one that sleeps before each answer).

Every boot starts from its own copy of a journal whose one boot calibrated, so that every side
takes the same bounded path, reusing the plan it verified, with the same history behind it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.bootrun import Booted, boot, clean_env, copy_journal
from bench.otlpreceiver import Receiver, closed_port, otlp_receiver
from bench.stats import median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most
from lifecycle.runtime.telemetry.tracing import CONFIGURE_AFTER_S, FLUSH_WITHIN_S

TARGET = 1.01
TROUBLE_TARGET = 1.05  # a collector in trouble: the export must still stay out of the way
SLOW_ANSWER_S = 2.0
SPANS_WITHIN_S = 10.0  # after the boot's exit: its last spans are flushed before it exits
BOOT_TIMEOUT_S = 600.0
OFF, LIVE, DOWN, SLOW = "off", "live", "down", "slow"
SERVICE = "lifecycle-bench"
# What configuring the SDK imports, timed in a fresh process after torch (a rank has imported
# torch by then).
SDK_IMPORT = """
import time, torch
started = time.perf_counter()
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
print(time.perf_counter() - started)
"""
IMPORT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    model: str
    rounds: int
    four_ranks: bool  # also live against off on four ranks


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(model="micro-video", rounds=1, four_ranks=False)
    return Sized(model="tiny-video", rounds=11, four_ranks=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Side:
    name: str
    env: dict[str, str]
    receiver: Receiver | None  # where its spans should arrive


def _template(settings: Settings, model: str, ranks: int) -> tuple[Path, Booted]:
    """A journal whose one boot calibrated (OTEL off): what every timed boot starts from."""
    db = settings.workdir / f"otel-template-{ranks}.db"
    booted = boot(
        _args(model, ranks), db=db, cwd=settings.workdir, env=clean_env(),
        timeout_s=BOOT_TIMEOUT_S, ranks=ranks,
    )  # fmt: skip
    return db, booted


def _args(model: str, ranks: int) -> list[str]:
    return ["--model", model, *(["--num-ranks", str(ranks)] if ranks > 1 else [])]


def _booter(
    settings: Settings, template: Path, model: str, ranks: int
) -> Callable[[Side, int], Booted]:
    def run(side: Side, index: int) -> Booted:
        db = settings.workdir / f"otel-{ranks}-{side.name}-{index}.db"
        copy_journal(template, db)
        booted = boot(
            _args(model, ranks), db=db, cwd=settings.workdir, env=side.env,
            timeout_s=BOOT_TIMEOUT_S, ranks=ranks,
        )  # fmt: skip
        db.unlink()
        if side.receiver is not None and side.name == LIVE:
            from lifecycle.runtime.telemetry.tracing import trace_id_of

            trace = f"{trace_id_of(booted.run_id):032x}"
            if not side.receiver.spans_of(trace, within_s=SPANS_WITHIN_S):
                raise BenchError(f"run {booted.run_id} exported no span to the live receiver")
        return booted

    return run


def sdk_import_s(cwd: Path) -> float:
    """Seconds to import what Tracing.start imports, in a fresh process after torch."""
    done = subprocess.run(
        [sys.executable, "-c", SDK_IMPORT], cwd=cwd, env=clean_env(), capture_output=True,
        text=True, timeout=IMPORT_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise BenchError(f"importing the OTel SDK exited {done.returncode}: {done.stderr[-300:]}")
    return float(done.stdout.strip().splitlines()[-1])


def _rounds(
    run: Callable[[Side, int], Booted], sides: tuple[Side, ...], rounds: int, label: str,
    imports: list[float] | None = None, cwd: Path | None = None,
) -> dict[str, list[Booted]]:  # fmt: skip
    """`rounds` rounds of every side, the order rotating so that each comes first in turn;
    with `imports`, the SDK's import timed once a round too."""
    found: dict[str, list[Booted]] = {side.name: [] for side in sides}
    for index in range(rounds):
        progress(f"otel-export: {label}, round {index + 1}/{rounds}")
        turn = index % len(sides)
        for side in (*sides[turn:], *sides[:turn]):
            found[side.name].append(run(side, index))
        if imports is not None and cwd is not None:
            imports.append(sdk_import_s(cwd))
    return found


def measure(settings: Settings) -> list[Row]:
    try:
        import opentelemetry.exporter.otlp.proto.http
        import opentelemetry.proto  # noqa: F401
    except ImportError:
        return [missing_extra("otel export: not run", extra="otel")]
    sized = _sized(settings)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        live = stack.enter_context(otlp_receiver())
        slow = stack.enter_context(otlp_receiver(delay_s=SLOW_ANSWER_S))
        down = f"http://127.0.0.1:{closed_port()}"
        endpoint = {LIVE: live.endpoint, DOWN: down, SLOW: slow.endpoint}

        def side(name: str, receiver: Receiver | None) -> Side:
            extra = {} if name == OFF else {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint[name]}
            env = clean_env({**extra, **({"OTEL_SERVICE_NAME": SERVICE} if extra else {})})
            return Side(name=name, env=env, receiver=receiver)

        sides = (side(OFF, None), side(LIVE, live), side(DOWN, None), side(SLOW, slow))
        for ranks in (1, 4) if sized.four_ranks else (1,):
            progress(f"otel-export: calibrating a journal, {sized.model} on {ranks} rank(s)")
            template, calibrated = _template(settings, sized.model, ranks)
            if "probe" not in calibrated.path:
                raise BenchError(f"the template's boot did not calibrate: {calibrated.path}")
            chosen = sides if ranks == 1 else sides[:2]
            run = _booter(settings, template, sized.model, ranks)
            imports: list[float] | None = [] if ranks == 1 else None
            boots = _rounds(
                run, chosen, sized.rounds, f"{ranks} rank(s)", imports, settings.workdir
            )
            paths = {b.path for side_boots in boots.values() for b in side_boots}
            if len(paths) != 1 or "probe" in next(iter(paths)):
                raise BenchError(f"the boots took different or calibrating paths: {paths}")
            rows.extend(
                _row(sized, ranks, name, boots, live=live, slow=slow)
                for name in (s.name for s in chosen)
                if name != OFF
            )
            if imports:
                rows.append(_import_row(imports, boots[OFF]))
    return rows


def _row(
    sized: Sized, ranks: int, name: str, boots: dict[str, list[Booted]], *, live: Receiver,
    slow: Receiver,
) -> Row:  # fmt: skip
    off, on = boots[OFF], boots[name]
    ratios = [a.ready_s / b.ready_s for a, b in zip(on, off, strict=True)]
    ratio = median(ratios)
    interval = median_interval(ratios)
    target = TARGET if name == LIVE else TROUBLE_TARGET
    warned = sum("traces could not be sent" in b.stderr for b in on)
    collector = {
        LIVE: f"a live OTLP/HTTP receiver on 127.0.0.1 (in the benchmark's process; it took"
        f" {live.posts} posts, {live.spans.total()} spans in all)",
        DOWN: "a closed port on 127.0.0.1 (connection refused)",
        SLOW: f"a receiver that sleeps {SLOW_ANSWER_S:g} s before answering each export"
        f" ({slow.posts} posts answered)",
    }[name]
    ranks_text = f"{ranks} rank{'s' if ranks > 1 else ''}"
    return Row(
        figure=f"otel export: startup to ready, collector {name}, {ranks_text}",
        value=format_seconds(median([b.ready_s for b in on])),
        baseline=format_seconds(median([b.ready_s for b in off])) + " export off",
        **ratio_at_most(ratio, target, spec=".2f"),
        how=(
            f"`lifecycle boot --model {sized.model}` on {ranks_text}, the launch to the last"
            f" rank's ready (replay show --json's startup total_s); A: OTEL_EXPORTER_OTLP_ENDPOINT"
            f" at {collector}; B: no OTEL_* variable; {sized.rounds} rounds, the sides' order"
            f" rotating, each boot on its own copy of a journal whose one boot calibrated (all"
            f" took the path {'>'.join(on[0].path[:-1])}); values are medians, the ratio the"
            f" median of the paired ratios A/B, in [{format_ratio(interval.low)},"
            f" {format_ratio(interval.high)}] with {interval.coverage:.1%} confidence (sign"
            f" test); from ready to the boot's exit (the parent's time to the exit less the"
            f" startup to ready): A {format_seconds(median(exits(on)))}, B"
            f" {format_seconds(median(exits(off)))} (a rank's spans are made and sent after its"
            f" ready, in at most {FLUSH_WITHIN_S:g} s at its end); A warned of unsent spans in"
            f" {warned} of {len(on)} boots"
        ),
    )


def exits(boots: list[Booted]) -> list[float]:
    """Each boot's exit after its ready: the parent's time to the exit less the startup."""
    return [b.wall_s - b.ready_s for b in boots]


def _import_row(imports: list[float], off: list[Booted]) -> Row:
    """What the SDK's import costs, and where a rank pays it: after its startup is over."""
    share = median([s / b.ready_s for s, b in zip(imports, off, strict=True)])
    return Row(
        figure="otel export: the SDK's import alone, 1 rank",
        value=format_seconds(median(imports)),
        baseline=format_seconds(median([b.ready_s for b in off])) + " export off",
        target="off the path to ready: imported once the startup is over",
        how=(
            "what configuring the SDK imports (the OTLP/HTTP exporter, the SDK's resources,"
            " tracer provider and batch processor), timed in a fresh process after torch, once"
            f" a round ({len(imports)} rounds, median); {share:.1%} of B's startup to ready,"
            " were it paid there: a rank holds its events until its ready action is done (or"
            f" {CONFIGURE_AFTER_S:g} s into a longer startup) and imports the SDK then, on a"
            " thread of its own, so it shows in the exit after ready above, not in the startup"
        ),
    )


BENCHMARK = Benchmark(name="otel-export", measure=measure)
