"""The field's failure on 4 ranks with default flags: how long after the first rank's fatal
error every rank of the run has exited with its journal closed, the agreed abort against the
process-group timeout the peers waited out before it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.crash import diagnose_json
from bench.historyboots import query
from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict

RANKS = 4
FAULT = "1:probe:raise"
FAILED_RANK = 1
TARGET_S = 5.0
DIST_TIMEOUT_S = 600.0  # --dist-timeout's default: what the peers waited for before
BOOT_TIMEOUT_S = 900.0
EXIT_POLL_S = 0.01
ENDINGS = ("failed",)  # the state every rank's journal ends in


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """One boot with the fault: seconds from the fault to the launcher's exit and to each
    rank's last event, and what `replay diagnose` made of it."""

    exited_s: float
    last_event_s: float  # the latest of the ranks' last events
    learned_s: float  # the slowest peer's learned_after_s in its `aborted` event
    ended: bool  # every rank's journal ends in `failed`
    culprit: int | None
    code: int


def _culprit(db: Path) -> int | None:
    ranks = diagnose_json(db, "latest")["culprit_ranks"]
    return ranks[0] if len(ranks) == 1 else None


def _once(workdir: Path, index: int) -> Ended:
    db = workdir / f"failfast-{index}.db"
    log = workdir / f"failfast-{index}.log"
    command = [sys.executable, "-m", "lifecycle", "boot", "--num-ranks", str(RANKS),
               "--fault", FAULT, "--db", str(db), "--log-level", "warning"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONWARNINGS": "ignore"}, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"the boot with --fault {FAULT} ran past {BOOT_TIMEOUT_S:.0f} s")
            time.sleep(EXIT_POLL_S)
        exited = time.time()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10.0)
    faults = query(db, "SELECT wall_time FROM events WHERE kind = 'fault_injected' AND rank = ?",
                    FAILED_RANK)  # fmt: skip
    if not faults:
        raise BenchError(f"rank {FAILED_RANK} journaled no fault_injected event (see {log})")
    fault_at = float(faults[0][0])
    lasts = query(
        db,
        "SELECT e.rank, e.wall_time, e.data FROM events e WHERE e.seq ="
        " (SELECT max(seq) FROM events x WHERE x.run_id = e.run_id AND x.rank = e.rank)",
    )
    learned = [
        float(json.loads(str(data))["learned_after_s"])
        for (data,) in query(db, "SELECT data FROM events WHERE kind = 'aborted'")
    ]
    # Closed: every rank journaled its end (a transition to failed); a heartbeat or a dump
    # may still follow it.
    ended_ranks = {
        rank
        for rank, data in query(db, "SELECT rank, data FROM events WHERE kind = 'transition'")
        if json.loads(str(data)).get("dest") in ENDINGS
    }
    ended = ended_ranks == set(range(RANKS))
    return Ended(
        exited_s=exited - fault_at,
        last_event_s=max(float(at) for _, at, _ in lasts) - fault_at,
        learned_s=max(learned, default=float("nan")),
        ended=ended,
        culprit=_culprit(db),
        code=int(proc.returncode),
    )


def measure(settings: Settings) -> list[Row]:
    boots = 1 if settings.quick else 3
    seen: list[Ended] = []
    for index in range(boots):
        progress(f"failfast: boot {index + 1}/{boots}, {RANKS} ranks, --fault {FAULT}")
        seen.append(_once(settings.workdir, index))
    exited = median([e.exited_s for e in seen])
    last_event = format_seconds(median([e.last_event_s for e in seen]))
    learned = format_seconds(median([e.learned_s for e in seen]))
    closed = sum(e.ended for e in seen)
    named = sum(e.culprit == FAILED_RANK for e in seen)
    return [
        Row(
            figure=f"fail fast: first rank's fatal error to every rank exited, {RANKS} ranks",
            value=format_seconds(exited),
            baseline=f"{format_seconds(DIST_TIMEOUT_S)} --dist-timeout (not waited out)",
            ratio=format_ratio(exited / DIST_TIMEOUT_S),
            target=verdict(f"<= {TARGET_S:g} s", met=exited <= TARGET_S and closed == boots),
            how=(
                f"`lifecycle boot --num-ranks {RANKS} --fault {FAULT}` on a fresh SQLite journal"
                " (default flags: tiny-video, calibrating, --on-peer-failure abort); from rank"
                f" {FAILED_RANK}'s fault_injected event to the launcher's exit (every rank's"
                f" process ended), median of {boots} boots (each: "
                + ", ".join(format_seconds(e.exited_s) for e in seen)
                + f"); the ranks' last events at +{last_event}, the slowest peer learned it"
                f" after {learned};"
                f" every rank's journal ended in `failed` in {closed} of {boots}; `replay"
                f" diagnose` named rank {FAILED_RANK} the culprit in {named} of {boots};"
                f" exit codes {sorted({e.code for e in seen})}"
            ),
        )
    ]


BENCHMARK = Benchmark(name="failfast", measure=measure)
