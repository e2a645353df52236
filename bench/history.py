"""Deadlines learned from history and heartbeats bounded after ready: how soon a silent hang is
journaled `stalled` once a few healthy startups are known, whether boots sharing the cores
stall falsely, what an idle server journals an hour, and what the lookup at gate-check costs
on a journal of 10,000 runs."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench.historyboots import MODEL, boot, finish, kill, query, run_ids
from bench.historyidle import idle_and_lookup
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict
from lifecycle.core.decisions.deadlines import MIN_RUNS, STALL_FACTOR, STALL_FLOOR_S

STALL_WAIT_S = 120.0
HANG_TARGET_S = 10.0
FIXED_DEADLINE_S = 300.0  # --state-deadline's default: what a hang waited for before


@dataclass(frozen=True, slots=True, kw_only=True)
class Paired:
    """The boots run two at a time: their stalls, and how close their states came to the
    deadlines their expectations set."""

    boots: int
    stalls: int
    closest: float  # the largest time in a state / its learned deadline
    closest_state: str
    learned: int  # boots that journaled learned deadlines


def _paired(db: Path, pairs: int, log: Path) -> Paired:
    before = set(run_ids(db))
    for index in range(pairs):
        progress(f"history: two boots at once, {index + 1}/{pairs}")
        both = [boot(db, log=log), boot(db, log=log)]
        for proc in both:
            finish(proc, log)
    new = [r for r in run_ids(db) if r not in before]
    stalls, closest, closest_state, learned = 0, 0.0, "-", 0
    for run_id in new:
        (stalled,) = query(
            db, "SELECT COUNT(*) FROM events WHERE run_id = ? AND kind = 'stalled'", run_id
        )
        stalls += int(stalled[0])
        expected = query(
            db, "SELECT data FROM events WHERE run_id = ? AND kind = 'expectations'", run_id
        )
        deadlines = {
            s["state"]: s["deadline_s"] for (d,) in expected for s in json.loads(str(d))["states"]
        }
        learned += bool(deadlines)
        for state, seconds in _durations(db, run_id).items():
            if state in deadlines and seconds / deadlines[state] > closest:
                closest, closest_state = seconds / deadlines[state], state
    return Paired(
        boots=len(new), stalls=stalls, closest=closest, closest_state=closest_state, learned=learned
    )


def _durations(db: Path, run_id: str) -> dict[str, float]:
    rows = query(db, "SELECT durations FROM startup_history WHERE run_id = ?", run_id)
    spent: dict[str, float] = {}
    for (text,) in rows:
        for state, seconds in json.loads(str(text)).items():
            spent[state] = max(spent.get(state, 0.0), float(seconds))
    return spent


@dataclass(frozen=True, slots=True, kw_only=True)
class Hang:
    """A boot hung silently in bounded-warm: how long after the hang its stall was journaled,
    and the deadline it was held to."""

    seconds: float | None  # None: no stall within STALL_WAIT_S
    deadline_s: float | None
    p95_s: float | None


def _hang(db: Path, log: Path) -> Hang:
    before = set(run_ids(db))
    proc = boot(db, "--fault", "0:bounded-warm:hang", log=log)
    try:
        deadline = time.monotonic() + STALL_WAIT_S
        while time.monotonic() < deadline:
            new = [r for r in run_ids(db) if r not in before]
            if new:
                stalled = query(
                    db,
                    "SELECT s.wall_time, s.data, f.wall_time FROM events s JOIN events f"
                    " ON f.run_id = s.run_id AND f.kind = 'fault_injected'"
                    " WHERE s.run_id = ? AND s.kind = 'stalled'",
                    new[0],
                )
                if stalled:
                    at, data, hung = stalled[0]
                    limit = float(json.loads(str(data))["deadline_s"])
                    return Hang(
                        seconds=float(at) - float(hung),
                        deadline_s=limit,
                        p95_s=_p95(db, new[0], "bounded-warm"),
                    )
            time.sleep(0.25)
        return Hang(seconds=None, deadline_s=None, p95_s=None)
    finally:
        kill(proc)


def _p95(db: Path, run_id: str, state: str) -> float | None:
    rows = query(db, "SELECT data FROM events WHERE run_id = ? AND kind = 'expectations'", run_id)
    for (data,) in rows:
        for expected in json.loads(str(data))["states"]:
            if expected["state"] == state:
                return float(expected["p95_s"])
    return None


def _stall_rows(settings: Settings) -> list[Row]:
    db = settings.workdir / "history.db"
    log = settings.workdir / "history-boots.log"
    for index in range(MIN_RUNS):
        progress(f"history: healthy boot {index + 1}/{MIN_RUNS} of the history")
        finish(boot(db, log=log), log)
    progress("history: a boot that hangs silently in bounded-warm")
    hang = _hang(db, log)
    pairs = 1 if settings.quick else 10
    paired = _paired(db, pairs, log)
    bounded = f"`lifecycle boot --model {MODEL}`, bounded path (LIFECYCLE_DISABLE_AUTO_RESIDENCY=1)"
    if hang.seconds is None:
        hang_value, hang_ratio, met = f"no stall in {STALL_WAIT_S:.0f} s", "-", False
    else:
        hang_value = format_seconds(hang.seconds)
        hang_ratio = format_ratio(hang.seconds / FIXED_DEADLINE_S)
        met = hang.seconds <= HANG_TARGET_S
    needed = "at least 20" if not settings.quick else f"{paired.boots} here; the full run: >= 20"
    return [
        Row(
            figure=f"history: silent hang to `stalled`, {MODEL} 1 rank, {MIN_RUNS} healthy runs",
            value=hang_value,
            baseline=f"{format_seconds(FIXED_DEADLINE_S)} --state-deadline (not waited out)",
            ratio=hang_ratio,
            target=verdict(f"<= {HANG_TARGET_S:g} s", met=met),
            how=f"{bounded}: {MIN_RUNS} healthy boots, then one with --fault"
            f" 0:bounded-warm:hang; the `stalled` event's wall time less the fault_injected"
            f" one's (the hang's start); the deadline it was held to"
            f" {_maybe(hang.deadline_s)} (bounded-warm's p95 {_maybe(hang.p95_s)} in the"
            f" history, x{STALL_FACTOR:g}, floor {STALL_FLOOR_S:g} s), less the time the boot"
            " had spent in bounded-warm when the hang began (the heartbeat thread wakes at the"
            " deadline)",
        ),
        Row(
            figure=f"history: false stalls, healthy {MODEL} boots two at once on 2 cores",
            value=f"{paired.stalls} of {paired.boots}",
            baseline=f"0 with the fixed {FIXED_DEADLINE_S:g} s",
            ratio=f"{paired.closest:.2f} closest",
            target=verdict(f"0 of {needed}", met=paired.stalls == 0),
            how=f"{bounded}, {pairs} pairs started together on the same journal after the"
            f" history above ({paired.learned} of them held to learned deadlines); `stalled`"
            f" events counted. Ratio: the longest time a boot spent in a state over the"
            f" deadline it was held to ({paired.closest_state})",
        ),
    ]


def _maybe(seconds: float | None) -> str:
    return "-" if seconds is None else format_seconds(seconds)


def measure(settings: Settings) -> list[Row]:
    return [*_stall_rows(settings), *idle_and_lookup(settings)]


BENCHMARK = Benchmark(name="history", measure=measure)
