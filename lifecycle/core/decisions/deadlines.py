"""How long each startup state takes, learned from earlier healthy runs of the same fingerprint
and path: the statistics, and the deadline past which a state counts as stalled (pure)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from lifecycle.core.format.events import Expectations
from lifecycle.core.format.records import StateExpectation
from lifecycle.core.format.states import State
from lifecycle.core.format.view import Span

# A state's deadline is learned once this many earlier healthy runs went through it; with
# fewer, the fixed --state-deadline applies (five runs put a p95 at their slowest).
MIN_RUNS = 5
# The newest runs of a key that a startup learns from: recent enough to follow a machine that
# got slower or faster, enough for a p95 that is not the single slowest run.
SAMPLE_RUNS = 64
# deadline = max(STALL_FLOOR_S, STALL_FACTOR x p95), chosen from healthy micro-video boots on
# the 2-core machine this was built on, with other work holding its load average at 11 to 19:
# 8 boots alone and 16 started two at a time. Two at a time took 1.7x (gate-check) and 2.2x
# (bounded-warm) the median time of those alone, and the slowest of them 2.4x the p95 of those
# alone (bounded-warm, 37.7 s against 15.7 s): a factor of 3 keeps a quarter above that. A
# state of about a second needs the floor instead: gate-check, 1.0 to 4.7 s alone, took up to
# 4.9 s beside another boot, and 8 s is 1.6x that, while a silent hang in a state of a second
# or two (micro-video's, on a quiet machine) is still journaled within the floor and one
# heartbeat interval: under 10 s, against the fixed deadline's 300.
STALL_FACTOR = 3.0
STALL_FLOOR_S = 8.0


class StartupPath(StrEnum):
    """The path a startup took, decided at gate-check: part of what its durations depend on."""

    CALIBRATED = "calibrated"  # the probe, the re-warm and the buffer drop ran
    REUSED = "reused"  # a verified residency plan was reused: bounded warmup only
    BOUNDED = "bounded"  # calibration closed for another reason: bounded warmup only


def history_key(fingerprint_key: str, path: StartupPath) -> str:
    """The key a startup's durations are kept and looked up under."""
    return f"{fingerprint_key}/{path.value}"


def key_parts(key: str) -> tuple[str, str]:
    """A history key's fingerprint key and path."""
    fingerprint, _, path = key.partition("/")
    return fingerprint, path


# A history row's durations hold, beside each state's, each component's load under this prefix
# (never a state's name): what `replay history` follows per fingerprint, and no deadline.
LOAD_PREFIX = "load "


def load_key(component: str) -> str:
    return f"{LOAD_PREFIX}{component}"


def durations_before_ready(spans: Iterable[Span]) -> tuple[tuple[str, float], ...]:
    """How long a rank spent in each state it left before it entered ready, in order (a state
    entered twice counts both times)."""
    spent: dict[str, float] = {}
    for span in spans:
        if span.state == State.READY:
            break
        if span.left_at is not None:
            spent[span.state] = spent.get(span.state, 0.0) + max(
                0.0, span.left_at - span.entered_at
            )
    return tuple(spent.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class RankDurations:
    """One healthy rank's startup, as the journal's history keeps it."""

    run_id: str
    rank: int
    key: str  # its history key: fingerprint and path
    ready_wall: float  # when it entered ready
    process_ready_s: float | None  # its process's start to ready, when journaled
    durations: tuple[tuple[str, float], ...]  # (state, seconds) before ready


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDurations:
    """One healthy run: each state's time on its slowest rank, ready when its last rank was."""

    run_id: str
    ready_wall: float
    process_ready_s: float | None
    durations: tuple[tuple[str, float], ...]

    def seconds(self, state: str) -> float | None:
        return next((s for name, s in self.durations if name == state), None)


def runs_of(ranks: Iterable[RankDurations]) -> list[RunDurations]:
    """The runs the rank rows make up, oldest first: a state's time is its slowest rank's
    (a rank waits for the others in a collective), so the history errs long, never short."""
    by_run: dict[str, list[RankDurations]] = {}
    for row in ranks:
        by_run.setdefault(row.run_id, []).append(row)
    runs = []
    for run_id, rows in by_run.items():
        slowest: dict[str, float] = {}
        for row in rows:
            for state, seconds in row.durations:
                slowest[state] = max(seconds, slowest.get(state, 0.0))
        process = [r.process_ready_s for r in rows if r.process_ready_s is not None]
        runs.append(
            RunDurations(
                run_id=run_id,
                ready_wall=max(r.ready_wall for r in rows),
                process_ready_s=max(process) if process else None,
                durations=tuple(slowest.items()),
            )
        )
    return sorted(runs, key=lambda r: (r.ready_wall, r.run_id))


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def p95(values: Sequence[float]) -> float:
    """The 95th percentile by nearest rank: a value some run took (the slowest of up to 20)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def stall_deadline(p95_s: float) -> float:
    """When a state with this p95 in enough earlier healthy runs counts as stalled."""
    return max(STALL_FLOOR_S, STALL_FACTOR * p95_s)


def expect(key: str, history: Sequence[RunDurations]) -> Expectations:
    """What a startup under `key` expects of each state still ahead of it at gate-check, from
    the newest SAMPLE_RUNS earlier healthy runs of its key (`history`, any order); no states
    with fewer than MIN_RUNS of them."""
    newest = sorted(history, key=lambda r: (r.ready_wall, r.run_id))[-SAMPLE_RUNS:]
    if len(newest) < MIN_RUNS:
        return Expectations(key=key, runs=len(newest), states=())
    order: dict[str, None] = {}
    for run in newest:
        order.update(
            (state, None)
            for state, _ in run.durations
            if state != State.CREATED and not state.startswith(LOAD_PREFIX)
        )
    states = []
    for state in order:
        values = [s for s in (run.seconds(state) for run in newest) if s is not None]
        if len(values) < MIN_RUNS:
            continue
        slow = p95(values)
        states.append(
            StateExpectation(
                state=state,
                median_s=median(values),
                p95_s=slow,
                count=len(values),
                deadline_s=stall_deadline(slow),
            )
        )
    return Expectations(key=key, runs=len(newest), states=tuple(states))
