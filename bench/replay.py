"""Replay show (every event folded) on synthetic 64-rank journals of growing size."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict

RANKS = 64
CFG = 2
ULYSSES = RANKS // CFG
RUN_ID = "bench-replay"


@dataclass(frozen=True, slots=True, kw_only=True)
class Timed:
    seconds: float
    peak_rss_bytes: int


def journal_of(settings: Settings, events: int) -> Path:
    """The synthetic journal of `events` events in this run's workdir, built on first use, so
    that the benchmarks that read one size share it."""
    done = settings.workdir / f"replay-{events}"
    if not done.is_dir():
        partial = settings.workdir / f"replay-{events}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        progress(f"replay: writing a {RANKS}-rank journal of {events:,} events")
        started = time.perf_counter()
        build_journal(partial / "journal.db", events)
        progress(f"replay: wrote it in {time.perf_counter() - started:.1f} s")
        os.rename(partial, done)  # the directory, so that any -wal file moves with the file
    return done / "journal.db"


def build_journal(path: Path, events: int) -> None:
    """A 64-rank run (CFG 2 x Ulysses 32) of `events` events: the states of a calibrated
    startup, its ready action, then collectives in each rank's Ulysses, CFG and world groups
    interleaved with heartbeats, as a long-serving server's journal looked before the ring."""
    from lifecycle.core.format.events import (
        ActionFinished,
        ActionStarted,
        CollectiveFinished,
        CollectiveStarted,
        Event,
        Heartbeat,
        Transition,
    )
    from lifecycle.core.format.records import PendingCollective
    from lifecycle.core.settings.config import ServerArgs, args_to_json
    from lifecycle.core.settings.modelspec import MODEL_PRESETS
    from lifecycle.store.journal import Journal
    from lifecycle.store.rows import RunRow

    # A model with enough heads for Ulysses 32, as the field's large video models have.
    model = dataclasses.replace(MODEL_PRESETS["tiny-video"], attention_heads=ULYSSES)
    args = ServerArgs(
        model=model, num_ranks=RANKS, cfg_parallel=CFG, ulysses=ULYSSES, calibrate=True
    )
    journal = Journal.open_for_write(str(path))
    journal.create_run(
        RunRow(
            run_id=RUN_ID,
            created_at=1.8e9,
            host="bench",
            world_size=RANKS,
            config=args_to_json(args),
            lifecycle_version="bench",
        )
    )
    states = ("gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready")
    ready_action = (
        ActionStarted(action="mark-ready"),
        ActionFinished(action="mark-ready", duration_s=0.01, ok=True),
    )
    per_rank = events // RANKS - len(ready_action)  # the loop's slots, besides those two
    for rank in range(RANKS):
        cfg_rank, u = divmod(rank, ULYSSES)
        groups = (
            (f"ulysses{cfg_rank}", tuple(range(cfg_rank * ULYSSES, (cfg_rank + 1) * ULYSSES))),
            (f"cfg{u}", tuple(c * ULYSSES + u for c in range(CFG))),
            ("world", tuple(range(RANKS))),
        )
        seqs = {name: 0 for name, _ in groups}
        writer = journal.writer(run_id=RUN_ID, rank=rank)
        batch: list[tuple[Event, str, float, int]] = []
        state, wall = "created", 1.8e9
        step = per_rank // (len(states) + 1) or 1
        i = 0
        while i < per_rank:
            wall += 0.01
            name, members = groups[(i // 3) % len(groups)]
            event: Event
            if i % step == 0 and i // step < len(states):
                dest = states[i // step]
                event = Transition(trigger="t", source=state, dest=dest)
                state = dest
            elif i % 3 == 0:
                event = Heartbeat(
                    uptime_s=wall - 1.8e9, in_state_s=1.0,
                    pending=PendingCollective(group=name, group_seq=seqs[name], op="all_to_all",
                                              purpose="ulysses-qkv", waiting_s=0.0),
                )  # fmt: skip
            elif i % 3 == 1:
                size = len(members)
                event = CollectiveStarted(
                    group=name, group_ranks=members, group_seq=seqs[name], op="all_to_all",
                    purpose="ulysses-qkv", dtype="bfloat16", shapes=((size, 1, 128, 3, 4, 64),) * 2,
                    input_splits=(1536,) * size, output_splits=(1536,) * size, timeout_s=600.0,
                )  # fmt: skip
            else:
                event = CollectiveFinished(
                    group=name, group_seq=seqs[name], op="all_to_all", duration_s=0.002
                )
                seqs[name] += 1
            batch.append((event, state, wall, i))
            if isinstance(event, Transition) and event.dest == "ready":
                # The ready action, started and finished: what makes a rank a serving one.
                batch.extend((e, state, wall, i) for e in ready_action)
            i += 1
            if len(batch) >= 4000:
                writer.append_batch(batch)
                batch = []
        if batch:
            writer.append_batch(batch)
        writer.close()
    journal.close()


# Runs one replay command and reports its own peak RSS (VmHWM) on the last stderr line. The
# rusage of a child counts the memory of the parent it was forked from (this benchmark's
# process, with torch), so the child measures itself instead.
_MEASURED = """
import re, sys
from replay.cli import main
try:
    status = main(sys.argv[1:])
finally:
    status_text = open("/proc/self/status").read()
    print("vmhwm", int(re.search(r"VmHWM:\\s+(\\d+)", status_text).group(1)) * 1024,
          file=sys.stderr)
sys.exit(status)
"""


def timed(argv: list[str], *, cwd: Path, script: str = _MEASURED) -> Timed:
    """Wall time and the peak resident memory of one replay command in a child process
    (`script`, given `argv`, prints its VmHWM last on stderr as _MEASURED does)."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], cwd=cwd, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, timeout=3600, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if done.returncode not in (0, 1, 3) or not last.startswith("vmhwm "):
        raise BenchError(
            f"replay {' '.join(argv[:2])} exited {done.returncode}: {done.stderr[-500:]}"
        )
    return Timed(seconds=seconds, peak_rss_bytes=int(last.split()[1]))


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


def measure(settings: Settings) -> list[Row]:
    sizes = (1_000, 10_000) if settings.quick else (10_000, 100_000, 1_000_000)
    repeats = 1 if settings.quick else 3
    journals = {size: journal_of(settings, size) for size in sizes}
    rows: list[Row] = []
    # `replay diagnose` reads summaries and is flat in the journal's size: see bench.scale.
    for command in ("show",):
        results: dict[int, list[Timed]] = {size: [] for size in sizes}
        for _ in range(repeats):  # sizes interleaved, repeated
            for size in sizes:
                argv = [command, RUN_ID, str(journals[size])]
                results[size].append(timed(argv, cwd=settings.workdir))
        smallest = sizes[0]
        base_per_event = median([t.seconds for t in results[smallest]]) / smallest
        base_rss = median([t.peak_rss_bytes for t in results[smallest]])
        for size in sizes:
            seconds = median([t.seconds for t in results[size]])
            rss = median([t.peak_rss_bytes for t in results[size]])
            per_event = seconds / size
            rows.append(
                Row(
                    figure=f"replay {command}, {size:,} events ({RANKS} ranks)",
                    value=f"{format_seconds(seconds)}, peak {_mib(rss)}",
                    baseline="-"
                    if size == smallest
                    else f"{format_seconds(base_per_event)}/event at {smallest:,}",
                    ratio="-"
                    if size == smallest
                    else f"{format_ratio(per_event / base_per_event)}"
                    f" time/event, {format_ratio(rss / base_rss)} memory",
                    target="linear time, flat memory"
                    if size == smallest
                    else verdict(
                        "time/event <= 1.25x, memory <= 1.25x",
                        met=per_event <= 1.25 * base_per_event and rss <= 1.25 * base_rss,
                    ),
                    how=f"`replay {command}` in a child process on a synthetic journal"
                    f" (CFG {CFG} x Ulysses {ULYSSES}: heartbeats and all-to-alls in each rank's"
                    f" groups); median of {repeats}, sizes interleaved; peak RSS is the child's"
                    f" VmHWM;"
                    f" {format_seconds(per_event)}/event",
                )
            )
    return rows


BENCHMARK = Benchmark(name="replay", measure=measure)
