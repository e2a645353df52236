"""Collective recording: a recorded all-to-all against the same call unrecorded, on gloo."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.compare import compared_seconds
from bench.journal import new_journal
from bench.procs import Pool, serve
from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_seconds

WORLD = 2
PG_TIMEOUT_S = 60.0
ROUND_TIMEOUT_S = 300.0
NUMEL = 256  # float32 elements per rank: 512 bytes to each peer
WARMUP_ITERS = 50
MODES = ("plain", "durable", "ring")
DURABLE_RUN = "bench-collectives-durable"
RING_RUN = "bench-collectives-ring"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    blocks: int
    iters: int  # collectives per block and mode


# Each figure: the timed mode, its label, and what the timing covers.
RECORDINGS = (
    (
        "durable",
        "durable (startup)",
        "RecordedGroup.all_to_all through a Recorder: collective_started and collective_finished"
        " each committed to SQLite (WAL, one journal file for both ranks); against"
        " dist.all_to_all_single unrecorded",
    ),
    (
        "ring",
        "ring (after ready)",
        "RecordedGroup.all_to_all through a Recorder: collective_started and collective_finished"
        " into the ring (Recorder.keep_collectives_in_ring), written to the journal only on"
        " trouble; against dist.all_to_all_single unrecorded",
    ),
    (
        "flush",
        "ring dump (on trouble only)",
        "Recorder.dump() of one ring block (2 records per collective, one batch transaction),"
        " per collective: what writing the ring costs when something goes wrong",
    ),
)


def _sized(settings: Settings) -> Sized:
    return Sized(blocks=6, iters=60) if settings.quick else Sized(blocks=30, iters=300)


def measure(settings: Settings) -> list[Row]:
    from lifecycle.core.format.fold import fold_run
    from lifecycle.serve.ranks.supervisor import free_port
    from lifecycle.store.journal import Journal

    sized = _sized(settings)
    db = settings.workdir / "collectives.db"
    new_journal(db, run_id=DURABLE_RUN, world_size=WORLD)
    new_journal(db, run_id=RING_RUN, world_size=WORLD)
    progress(f"collectives: 2 gloo processes, {sized.blocks} blocks x {sized.iters} per mode")
    port = free_port()
    payloads = [
        {
            "rank": rank,
            "port": port,
            "db": str(db),
            "blocks": sized.blocks,
            "iters": sized.iters,
        }
        for rank in range(WORLD)
    ]
    with Pool(
        "bench.collectives", size=WORLD, workdir=settings.workdir, timeout_s=ROUND_TIMEOUT_S
    ) as pool:
        results = pool.round(payloads)
    expected = 2 * (WARMUP_ITERS + sized.blocks * sized.iters)
    with Journal.open_for_read(str(db)) as journal:
        for run_id in (DURABLE_RUN, RING_RUN):
            for rank, view in fold_run(journal.read(run_id=run_id)).items():
                found = sum(g.count for g in view.groups)
                if found * 2 != expected:
                    raise BenchError(
                        f"{run_id} rank {rank}: {found} collectives journaled, expected"
                        f" {expected // 2}"
                    )
    dropped = sum(int(r["ring_dropped"]) for r in results)
    if dropped:
        raise BenchError(f"the collective ring dropped {dropped} records")
    rank0: dict[str, list[float]] = {k: list(results[0][k]) for k in (*MODES, "flush")}
    plain = median(rank0["plain"])
    how = (
        f"2 gloo processes on 127.0.0.1, all_to_all_single of {NUMEL} float32 per rank"
        f" (async_op=True, wait); {sized.blocks} blocks x {sized.iters} collectives per mode,"
        f" modes interleaved block by block in rotating order; rank 0's medians of the"
        f" per-block means; every record read back from the journal"
    )
    return [
        compared_seconds(
            figure=f"collective recording, {label}",
            value_s=median(rank0[mode]),
            baseline_s=plain,
            value_note=f"/collective{_extra(mode, rank0)}",
            baseline_note=" unrecorded",
            target="no target given",
            how=f"{method}; {how}",
        )
        for mode, label, method in RECORDINGS
    ]


def _extra(mode: str, rank0: dict[str, list[float]]) -> str:
    """The median over blocks of (recorded - plain), both per collective; a flush is the
    ring's deferred write, not a recorded call beside a plain one, and has none."""
    if mode == "flush":
        return ""
    extra = median([r - p for r, p in zip(rank0[mode], rank0["plain"], strict=True)])
    return f" (+{format_seconds(extra)})"


BENCHMARK = Benchmark(name="collectives", measure=measure)


# ---------------------------------------------------------------------------------------------
# The worker process


def _never_skip(group: str, group_seq: int, op: str) -> bool:
    return False


def collective_task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """Join the gloo group and open both recorders; once released, run the blocks."""
    import torch
    import torch.distributed as dist

    from lifecycle.core.settings.config import DEFAULT_RING_CAPACITY
    from lifecycle.runtime.group.comm import RecordedGroup
    from lifecycle.runtime.group.pending import PendingTracker
    from lifecycle.runtime.recorder import Recorder
    from lifecycle.serve.logs import configure_logging
    from lifecycle.store.journal import Journal

    rank = int(payload["rank"])
    torch.set_num_threads(1)
    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{int(payload['port'])}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    log_stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed after the work
    configure_logging(json=False, level="info", stream=log_stream)
    journal = Journal.open_for_write(str(payload["db"]))
    durable_recorder = Recorder(journal.writer(run_id=DURABLE_RUN, rank=rank))
    ring_recorder = Recorder(journal.writer(run_id=RING_RUN, rank=rank))
    ring_recorder.keep_collectives_in_ring(DEFAULT_RING_CAPACITY)
    tracker = PendingTracker()
    ranks = tuple(range(WORLD))

    def group(recorder: Recorder) -> RecordedGroup:
        return RecordedGroup(
            name="world",
            ranks=ranks,
            process_group=dist.group.WORLD,
            sink=recorder,
            timeout_s=PG_TIMEOUT_S,
            skip=_never_skip,
            tracker=tracker,
        )

    durable, ring = group(durable_recorder), group(ring_recorder)
    inp = torch.arange(NUMEL, dtype=torch.float32) + rank * NUMEL
    out = torch.empty_like(inp)
    wait_timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)

    def plain() -> None:
        work = dist.all_to_all_single(out, inp, async_op=True)
        if work is not None and not work.wait(timeout=wait_timeout):
            raise RuntimeError("all_to_all_single wait returned false")

    calls: dict[str, Callable[[], None]] = {
        "plain": plain,
        "durable": lambda: durable.all_to_all(out, inp, purpose="bench"),
        "ring": lambda: ring.all_to_all(out, inp, purpose="bench"),
    }
    blocks, iters = int(payload["blocks"]), int(payload["iters"])

    def work() -> dict[str, Any]:
        per_op: dict[str, list[float]] = {mode: [] for mode in (*MODES, "flush")}
        for mode in MODES:
            for _ in range(WARMUP_ITERS):
                calls[mode]()
        ring_recorder.dump("bench")
        for block in range(blocks):
            shift = block % len(MODES)
            for mode in (*MODES[shift:], *MODES[:shift]):
                call = calls[mode]
                started = time.perf_counter()
                for _ in range(iters):
                    call()
                per_op[mode].append((time.perf_counter() - started) / iters)
                if mode == "ring":
                    started = time.perf_counter()
                    ring_recorder.dump("bench")
                    per_op["flush"].append((time.perf_counter() - started) / iters)
        dropped = ring_recorder.ring_dropped
        durable_recorder.close()
        ring_recorder.close()
        journal.close()
        dist.destroy_process_group()
        log_stream.close()
        return {**per_op, "ring_dropped": dropped}

    return work


if __name__ == "__main__":
    serve(collective_task)
