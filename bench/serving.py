"""Journal rows per request: a real `lifecycle serve` answering /generate after ready."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, at_most, format_ratio, verdict
from lifecycle.core.settings.modelspec import MODEL_PRESETS, ModelSpec

if TYPE_CHECKING:
    from lifecycle.runtime.group.comm import Comm
    from lifecycle.runtime.pipeline import Pipeline

REPO = Path(__file__).resolve().parent.parent
RANKS = 2
STEP_COUNTS = (4, 20)
# A small request, so that twenty steps take a moment on two CPU cores.
SHAPE = {"width": 256, "height": 192, "frames": 9}
ROWS_TARGET = 10.0
# Steps and blocks may move the count by less than a row: anything that grew with them would
# add a row per step or block at least.
SPREAD_LIMIT = 1.0
# Rows per request before the ring, when every collective after ready was journaled.
ROWS_BEFORE = 900
READY_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
COLLECTIVE_KINDS = frozenset({"collective_started", "collective_finished"})
HEARTBEAT = "heartbeat"
RECORDS_PER_COLLECTIVE = 2  # collective_started and collective_finished
DEEPER_BLOCKS = 8


def _deeper_factory(spec: ModelSpec, comm: Comm) -> Pipeline:
    from lifecycle.runtime.pipeline.tiny import TinyVideoPipeline
    from lifecycle.runtime.pipeline.tinyconfig import TinyConfig

    cfg = TinyConfig(heads=spec.attention_heads, layers=DEEPER_BLOCKS)
    return TinyVideoPipeline(spec, comm=comm, cfg=cfg)


# `lifecycle serve --pipeline bench.serving:DEEPER`: micro-video with twice its DiT blocks
# (TinyConfig.layers is 4), so that a row per block and step would show in the count.
DEEPER = (
    dataclasses.replace(MODEL_PRESETS["micro-video"], name="micro-video-8-blocks"),
    _deeper_factory,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Model:
    label: str
    blocks: int
    args: tuple[str, ...]


MICRO = Model(label="micro-video", blocks=4, args=("--model", "micro-video"))
MICRO_DEEPER = Model(
    label="micro-video-8-blocks",
    blocks=DEEPER_BLOCKS,
    args=("--pipeline", "bench.serving:DEEPER", "--model", "micro-video-8-blocks"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Tally:
    """The journal's rows by kind (all ranks: the file holds one run), and the collectives its
    request_finished rows say ran, whose records stayed in the ring."""

    rows: Counter[str]
    ring_collectives: int

    def __sub__(self, earlier: Tally) -> Tally:
        return Tally(
            rows=self.rows - earlier.rows,
            ring_collectives=self.ring_collectives - earlier.ring_collectives,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """What the journal gained while one model served `requests` requests of `steps` steps."""

    blocks: int
    steps: int
    requests: int
    gained: Tally
    seconds: float

    def per_request_per_rank(self, *, heartbeats: bool) -> float:
        rows = self.gained.rows
        counted = sum(n for kind, n in rows.items() if heartbeats or kind != HEARTBEAT)
        return counted / (self.requests * RANKS)

    @property
    def unringed_per_request_per_rank(self) -> float:
        """The rows these requests would have written with every collective journaled."""
        held = RECORDS_PER_COLLECTIVE * self.gained.ring_collectives
        return self.per_request_per_rank(heartbeats=False) + held / (self.requests * RANKS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    phases: tuple[Phase, ...]
    warmup_rows_per_rank: float  # the first request's rows: staging buffers for the shape


class ServeProcess:
    """`lifecycle serve OPTIONS` on a free loopback port, in a session of its own (its rank
    processes end with it), its output in a log beside its journal. As a context manager: ready
    (/health 200) on the way in, stopped on the way out."""

    def __init__(
        self,
        *,
        label: str,
        options: Sequence[str],
        db: Path,
        cwd: Path,
        env: Mapping[str, str],
        ready_within: float,
        request_timeout_s: float,
    ) -> None:
        from lifecycle.serve.ranks.supervisor import free_port

        self.label = label
        self.db = db
        self.log_path = db.with_suffix(".log")
        self.ready_within = ready_within
        self.request_timeout_s = request_timeout_s
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "lifecycle", "serve", *options, "--db", str(db),
                   "--port", str(port), "--log-level", "warning"]  # fmt: skip
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                command, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, **env}, start_new_session=True,
            )  # fmt: skip

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_within
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"{self.label}: serve exited {self.proc.returncode}: {self.tail()}"
                )
            # A 503 (still booting) is an HTTPError, an OSError, as a refused connection is.
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5.0) as response,
            ):
                if response.status == 200:
                    return
            time.sleep(0.1)
        raise BenchError(
            f"{self.label}: /health not 200 within {self.ready_within:.0f} s: {self.tail()}"
        )

    def post_generate(self, body: Mapping[str, Any]) -> tuple[float, bytes]:
        """POST /generate with `body`: the seconds the client waited, and the reply's body."""
        request = urllib.request.Request(
            f"{self.url}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
                content: bytes = response.read()
        except OSError as exc:  # HTTPError included: a status other than 2xx
            raise BenchError(f"{self.label}: POST /generate failed: {exc}") from None
        return time.perf_counter() - started, content

    def stop(self) -> None:
        """SIGTERM and wait; the whole session is killed if it has not stopped in time."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                progress(f"{self.label}: serve did not stop on SIGTERM; killing it")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # rank processes left behind, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)

    def tail(self) -> str:
        text = self.log_path.read_text(errors="replace").strip()
        return text.splitlines()[-1][:300] if text else "(no output)"


class Server(ServeProcess):
    """`lifecycle serve` of `model` in front of `ranks` rank processes, its journal `db`."""

    def __init__(
        self,
        settings: Settings,
        model: Model,
        *,
        ranks: int = RANKS,
        db: Path | None = None,
        extra: tuple[str, ...] = (),
        ready_within: float = READY_TIMEOUT_S,
    ) -> None:
        pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(":")
        super().__init__(
            label=model.label,
            options=(*model.args, "--num-ranks", str(ranks), *extra),
            db=db or settings.workdir / f"serving-{model.label}.db",
            cwd=settings.workdir,
            env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath},
            ready_within=ready_within,
            request_timeout_s=REQUEST_TIMEOUT_S,
        )

    def generate(self, steps: int, shape: dict[str, int] | None = None) -> None:
        self.post_generate(
            {"prompt": "a lighthouse in a storm", **(shape or SHAPE), "steps": steps}
        )

    def tally(self) -> Tally:
        conn = sqlite3.connect(self.db, timeout=30.0)
        try:
            kinds = Counter(dict(conn.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind")))
            (held,) = conn.execute(
                "SELECT COALESCE(SUM(json_extract(data, '$.collectives')), 0) FROM events"
                " WHERE kind = 'request_finished'"
            ).fetchone()
        finally:
            conn.close()
        return Tally(rows=kinds, ring_collectives=int(held))


# `with serving(settings, model, ...) as server:` (bench.compilecache's too): a Server, ready
# on the way in, stopped on the way out.
serving = Server


def _served(settings: Settings, model: Model, *, requests: int) -> Served:
    progress(f"serving: {model.label}, {RANKS} ranks, {requests} requests per step count")
    with serving(settings, model) as server:
        before = server.tally()
        server.generate(STEP_COUNTS[0])
        at = server.tally()
        warmup_rows = (at - before).rows.total() / RANKS
        phases = []
        for steps in STEP_COUNTS:
            began = time.monotonic()
            for _ in range(requests):
                server.generate(steps)
            after = server.tally()
            phases.append(
                Phase(
                    blocks=model.blocks,
                    steps=steps,
                    requests=requests,
                    gained=after - at,
                    seconds=time.monotonic() - began,
                )
            )
            at = after
    return Served(phases=tuple(phases), warmup_rows_per_rank=warmup_rows)


def measure(settings: Settings) -> list[Row]:
    requests = 2 if settings.quick else 5
    models = (MICRO,) if settings.quick else (MICRO, MICRO_DEEPER)
    served = [_served(settings, model, requests=requests) for model in models]
    phases = [phase for each in served for phase in each.phases]
    quiet = [phase.per_request_per_rank(heartbeats=False) for phase in phases]
    worst, spread = max(quiet), max(quiet) - min(quiet)
    heaviest = max(phases, key=lambda p: p.unringed_per_request_per_rank)
    rows = Counter[str]()
    for phase in phases:
        rows.update(phase.gained.rows)
    requests_served = sum(phase.requests for phase in phases)
    with_heartbeats = rows.total() / (requests_served * RANKS)
    seconds = sum(phase.seconds for phase in phases)
    beats_per_s = rows[HEARTBEAT] / (seconds * RANKS)
    collective_rows = sum(rows[kind] for kind in COLLECTIVE_KINDS)
    by_phase = "; ".join(
        f"{p.blocks} blocks, steps {p.steps}: {p.per_request_per_rank(heartbeats=False):.2f}"
        f" ({p.unringed_per_request_per_rank:.0f} with collectives journaled)"
        for p in phases
    )
    what = (
        f"`lifecycle serve --num-ranks {RANKS}` subprocess, "
        + " and ".join(f"{m.label} ({m.blocks} DiT blocks)" for m in models)
        + f"; after /health 200 and one warm-up request (its rows, staging buffers for the"
        f" shape: {max(s.warmup_rows_per_rank for s in served):.1f}/rank), {requests} POST"
        f" /generate {SHAPE['width']}x{SHAPE['height']}x{SHAPE['frames']} per step count,"
        f" one after another; journal rows counted by kind before and after"
    )
    return [
        Row(
            figure="journal rows per /generate per rank after ready, healthy",
            value=f"{worst:.2f} rows (heartbeats apart)",
            baseline=f"{heaviest.unringed_per_request_per_rank:.0f} with each collective"
            f" journaled ({heaviest.blocks} blocks, steps {heaviest.steps})",
            ratio=format_ratio(worst / heaviest.unringed_per_request_per_rank),
            target=verdict(
                f"<= {ROWS_TARGET:g}, independent of steps and blocks",
                met=worst <= ROWS_TARGET and spread < SPREAD_LIMIT,
            ),
            how=f"{what}; the worst of: {by_phase}; spread {spread:.2f}; rows by kind:"
            f" {_kinds(rows)}; collective rows after ready: {collective_rows}. Baseline: these"
            f" rows plus {RECORDS_PER_COLLECTIVE} per collective that request_finished counts"
            f" (the ring held them); before the ring, ~{ROWS_BEFORE}",
        ),
        Row(
            figure="journal rows per /generate per rank after ready, incl. heartbeats",
            value=f"{with_heartbeats:.2f} rows",
            target=at_most(with_heartbeats, ROWS_TARGET, spec="g"),
            how=f"{what}; every row over the same requests / (requests x ranks); heartbeats"
            f" {beats_per_s:.2f}/s per rank (default interval) over {seconds:.1f} s of"
            f" requests: they grow with time served, not with requests",
        ),
    ]


def _kinds(kinds: Counter[str]) -> str:
    return ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))


BENCHMARK = Benchmark(name="serving", measure=measure)
