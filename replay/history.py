"""`replay history`: per fingerprint and path, how long each startup state took in the
journal's healthy startups, their startup to ready, and the runs that regressed; read from the
startup history the ranks keep, never from the events. `history_rows` reads it, `histories`
gives the facts, `format_history` and `history_json` say them."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.decisions.deadlines import (
    LOAD_PREFIX,
    MIN_RUNS,
    RankDurations,
    RunDurations,
    key_parts,
    median,
    p95,
    runs_of,
)
from lifecycle.core.format.text import clean
from replay.load import Journals, RunInfo
from replay.views.render import Style, table

# A run regressed when a state, or its startup, took more than this many times the median of
# the same key's runs before it (once there are MIN_RUNS of them)...
REGRESSION_FACTOR = 1.5
# ...and at least this much longer: a state of milliseconds doubles on any scheduler hiccup.
REGRESSION_MIN_EXCESS_S = 0.5
STARTUP = "startup to ready"  # runs.created_at (the launch) to the last rank's ready
FROM_PROCESS = "startup from process start"  # each rank's process start to its ready, the slowest


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    """One measure over a key's runs: a state's time, or a startup's."""

    name: str
    median_s: float
    p95_s: float
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Regression:
    """A run that took longer than REGRESSION_FACTOR x the median of the runs before it."""

    run_id: str
    what: str  # a state, STARTUP or FROM_PROCESS
    seconds: float
    median_s: float  # of the runs before it
    runs_before: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.median_s if self.median_s > 0 else float("inf")


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyHistory:
    """The healthy startups of one fingerprint and path, oldest to newest."""

    key: str
    fingerprint: str
    path: str
    model: str  # of its newest run, as the run's config names it
    layout: str
    runs: int
    first_run: str
    last_run: str
    states: tuple[Stats, ...]  # in the order the startups went through them
    loads: tuple[Stats, ...]  # each component's load, in the order they began
    startup: tuple[Stats, ...]  # STARTUP and FROM_PROCESS, where known
    regressions: tuple[Regression, ...]


def history_rows(journals: Journals, *, say_older: bool) -> list[RankDurations]:
    """The startup history of every journal given, a rank in several read from the first;
    what cannot be read is one of `journals.problems`, and with `say_older` so is a journal
    from before the history."""
    from lifecycle.core.errors import JournalError
    from lifecycle.store.learned.history import HISTORY_REVISION, has_history, history_of

    rows: dict[tuple[str, int], RankDurations] = {}
    for journal in journals.sources:
        if not has_history(journal.revision):
            if say_older:
                journals.problems.append(
                    f"{journal.location}: at revision {journal.revision}, before the startup"
                    f" history ({HISTORY_REVISION}): `lifecycle db upgrade` keeps it from then on"
                )
            continue
        try:
            found = history_of(journal.engine, journal.location, journal.revision)
        except JournalError as exc:
            journals.problems.append(str(exc))
            continue
        if (skipped := found.warning(journal.location)) is not None:
            journals.problems.append(skipped)
        for row in found.rows:
            rows.setdefault((row.run_id, row.rank), row)
    return list(rows.values())


def histories(runs: Iterable[RunInfo], rows: Iterable[RankDurations]) -> list[KeyHistory]:
    """Each key's history, by model and then key."""
    infos = {run.run_id: run for run in runs}
    keyed: dict[str, list[RankDurations]] = {}
    for row in rows:
        keyed.setdefault(row.key, []).append(row)
    found = [_key_history(key, runs_of(rows), infos) for key, rows in keyed.items()]
    return sorted(found, key=lambda h: (h.model, h.layout, h.key))


def _key_history(key: str, runs: list[RunDurations], infos: dict[str, RunInfo]) -> KeyHistory:
    series: dict[str, list[tuple[str, float]]] = {}
    startup: dict[str, list[tuple[str, float]]] = {STARTUP: [], FROM_PROCESS: []}
    for run in runs:
        for state, seconds in run.durations:
            series.setdefault(state, []).append((run.run_id, seconds))
        info = infos.get(run.run_id)
        if info is not None:
            startup[STARTUP].append((run.run_id, run.ready_wall - info.created_at))
        if run.process_ready_s is not None:
            startup[FROM_PROCESS].append((run.run_id, run.process_ready_s))
    measured = {**series, **{name: values for name, values in startup.items() if values}}
    order = {run.run_id: index for index, run in enumerate(runs)}
    regressions = sorted(
        (r for name, values in measured.items() for r in _regressions(name, values)),
        key=lambda r: (order[r.run_id], r.what),
    )
    newest = infos.get(runs[-1].run_id)
    fingerprint, path = key_parts(key)
    return KeyHistory(
        key=key,
        fingerprint=fingerprint,
        path=path,
        model=newest.model_name if newest is not None else "?",
        layout=_layout(newest),
        runs=len(runs),
        first_run=runs[0].run_id,
        last_run=runs[-1].run_id,
        states=tuple(
            _stats(name, values)
            for name, values in series.items()
            if not name.startswith(LOAD_PREFIX)
        ),
        loads=tuple(
            _stats(name, values) for name, values in series.items() if name.startswith(LOAD_PREFIX)
        ),
        startup=tuple(_stats(name, values) for name, values in startup.items() if values),
        regressions=tuple(regressions),
    )


def _stats(name: str, values: Sequence[tuple[str, float]]) -> Stats:
    seconds = [s for _, s in values]
    return Stats(name=name, median_s=median(seconds), p95_s=p95(seconds), count=len(seconds))


def _regressions(what: str, values: Sequence[tuple[str, float]]) -> list[Regression]:
    """The runs whose `what` took more than REGRESSION_FACTOR x the median of the runs before
    them, in order (a running median: each run is held to those before it, not after)."""
    before: list[float] = []
    found = []
    for run_id, seconds in values:
        if len(before) >= MIN_RUNS:
            middle = median(before)
            if seconds > REGRESSION_FACTOR * middle and seconds - middle >= REGRESSION_MIN_EXCESS_S:
                found.append(
                    Regression(
                        run_id=run_id,
                        what=what,
                        seconds=seconds,
                        median_s=middle,
                        runs_before=len(before),
                    )
                )
        bisect.insort(before, seconds)
    return found


def _layout(run: RunInfo | None) -> str:
    if run is None:
        return "?"
    config = run.config
    return (
        f"ranks={config.get('num_ranks', '?')} cfg={config.get('cfg_parallel', '?')}"
        f" ulysses={config.get('ulysses', '?')}"
    )


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s"


def format_history(found: Sequence[KeyHistory], style: Style) -> str:
    """Each key's table of states and startup, and its regressions, one block per key."""
    if not found:
        return "no healthy startups in the history"
    blocks = []
    for h in found:
        head = (
            f"{style.bold(h.model)}  {clean(h.layout)}  path {clean(h.path)}"
            f"  fingerprint {clean(h.fingerprint)}  {h.runs} run(s), {clean(h.first_run)}"
            f" to {clean(h.last_run)}"
        )
        rows = [
            [s.name, _s(s.median_s), _s(s.p95_s), s.count]
            for s in (*h.states, *h.loads, *h.startup)
        ]
        lines = [
            head,
            *("  " + line for line in table(["", "median", "p95", "runs"], rows).splitlines()),
        ]
        if h.regressions:
            lines.append(
                f"  regressed (over {REGRESSION_FACTOR:g}x the median of the runs before):"
            )
            lines.extend(
                f"    run {clean(r.run_id)}: {r.what} {_s(r.seconds)}, {r.ratio:.1f}x the median"
                f" {_s(r.median_s)} of {r.runs_before} run(s) before it"
                for r in h.regressions
            )
        else:
            lines.append("  no run regressed")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def history_json(found: Sequence[KeyHistory]) -> dict[str, Any]:
    def stats(s: Stats) -> dict[str, Any]:
        return {"median_s": s.median_s, "p95_s": s.p95_s, "count": s.count}

    return {
        "regression_factor": REGRESSION_FACTOR,
        "histories": [
            {
                "key": h.key,
                "fingerprint": h.fingerprint,
                "path": h.path,
                "model": h.model,
                "layout": h.layout,
                "runs": h.runs,
                "first_run": h.first_run,
                "last_run": h.last_run,
                "states": [{"state": s.name, **stats(s)} for s in h.states],
                "loads": [
                    {"component": s.name.removeprefix(LOAD_PREFIX), **stats(s)} for s in h.loads
                ],
                "startup_to_ready": next((stats(s) for s in h.startup if s.name == STARTUP), None),
                "startup_from_process_start": next(
                    (stats(s) for s in h.startup if s.name == FROM_PROCESS), None
                ),
                "regressions": [
                    {
                        "run_id": r.run_id,
                        "what": r.what,
                        "seconds": r.seconds,
                        "median_s": r.median_s,
                        "runs_before": r.runs_before,
                        "ratio": r.ratio,
                    }
                    for r in h.regressions
                ],
            }
            for h in found
        ],
    }
