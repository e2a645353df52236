"""Deadlines learned from history and heartbeats bounded after ready: how soon a silent hang is
journaled `stalled` once a few healthy startups are known, whether boots sharing the cores
stall falsely, what an idle server journals an hour, and what the lookup at gate-check costs
on a journal of 10,000 runs."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.calibration import BOUNDED_ENV
from bench.compare import compared_seconds
from bench.stats import interleave, median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict
from lifecycle.core.decisions.deadlines import (
    MIN_RUNS,
    SAMPLE_RUNS,
    STALL_FACTOR,
    STALL_FLOOR_S,
    StartupPath,
    expect,
    history_key,
    runs_of,
)
from lifecycle.runtime.group.heartbeat import SLOW_BEAT_S

REPO = Path(__file__).resolve().parent.parent
MODEL = "micro-video"
BOOT_TIMEOUT_S = 300.0
STALL_WAIT_S = 120.0
HANG_TARGET_S = 10.0
FIXED_DEADLINE_S = 300.0  # --state-deadline's default: what a hang waited for before
IDLE_BYTES_TARGET = 10 * 1024
BYTES_BEFORE = "about 1.7 MiB"
LOOKUP_TARGET_S = 0.050
JOURNAL_RUNS = 10_000
KEYS = 20  # fingerprints and paths the 10,000 runs are spread over
READY_TIMEOUT_S = 240.0
# A boot on the bounded path with calibration closed: the same path, and so the same history
# key, every time, whatever a loaded machine makes of a residency plan's verification.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", **BOUNDED_ENV}


def _boot(db: Path, *extra: str, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "lifecycle", "boot", "--model", MODEL, "--db", str(db),
               "--log-level", "warning", *extra]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            command, cwd=db.parent, env=ENV, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        code = proc.wait(timeout=BOOT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise BenchError(f"a boot did not finish in {BOOT_TIMEOUT_S:.0f} s") from None
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:]
        raise BenchError(f"a healthy boot exited {code}: {' '.join(tail)[:300]}")


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def query(db: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    """Rows of `sql` from the SQLite journal `db`, read-only."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30.0)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def _run_ids(db: Path) -> list[str]:
    if not db.exists():
        return []
    return [str(r) for (r,) in query(db, "SELECT run_id FROM runs ORDER BY created_at")]


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
    before = set(_run_ids(db))
    for index in range(pairs):
        progress(f"history: two boots at once, {index + 1}/{pairs}")
        both = [_boot(db, log=log), _boot(db, log=log)]
        for proc in both:
            _finish(proc, log)
    new = [r for r in _run_ids(db) if r not in before]
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
    before = set(_run_ids(db))
    proc = _boot(db, "--fault", "0:bounded-warm:hang", log=log)
    try:
        deadline = time.monotonic() + STALL_WAIT_S
        while time.monotonic() < deadline:
            new = [r for r in _run_ids(db) if r not in before]
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
        _kill(proc)


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
        _finish(_boot(db, log=log), log)
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


@contextlib.contextmanager
def _serving(settings: Settings, db: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    from lifecycle.serve.ranks.supervisor import free_port

    port = free_port()
    log = settings.workdir / "history-serve.log"
    command = [sys.executable, "-m", "lifecycle", "serve", "--model", MODEL, "--db", str(db),
               "--port", str(port), "--log-level", "warning"]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=settings.workdir, env=ENV, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"lifecycle serve not healthy: {log.read_text()[-300:]}")
            time.sleep(0.2)
        yield proc, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60.0)
        except subprocess.TimeoutExpired:
            _kill(proc)


def _healthy(url: str) -> bool:
    with (
        contextlib.suppress(OSError),
        urllib.request.urlopen(f"{url}/health", timeout=5.0) as response,
    ):
        return bool(response.status == 200)
    return False


# What one event row costs beyond its own text: its numbers and record header, and its entries
# in the primary key's index and the (run_id, kind) index.
ROW_OVERHEAD_BYTES = 64
ROW_BYTES = (
    f"LENGTH(data) + LENGTH(kind) * 2 + LENGTH(state) + LENGTH(run_id) * 3 + {ROW_OVERHEAD_BYTES}"
)


def _idle_and_lookup(settings: Settings) -> list[Row]:
    """The idle server's row and, measured while it idles, the lookup's."""
    db = settings.workdir / "history-serve.db"
    window = 30.0 if settings.quick else 120.0
    progress(f"history: `lifecycle serve` idle for {window:.0f} s")
    with _serving(settings, db) as (_proc, url):
        time.sleep(3.0)  # past the beat that journals the ready action's last marks
        (run_id,) = _run_ids(db)[-1:]
        began = time.time()
        size_before = _file_bytes(db)
        lookup = _lookup_row(settings)
        time.sleep(max(0.0, window - (time.time() - began)))
        ended = time.time()
        size_after = _file_bytes(db)
        rows = query(
            db,
            f"SELECT kind, {ROW_BYTES} FROM events WHERE run_id = ? AND wall_time > ?"
            " AND wall_time <= ?",
            run_id,
            began,
            ended,
        )
        (beat,) = query(
            db, "SELECT last_heartbeat_wall FROM rank_summaries WHERE run_id = ?", run_id
        )
        with urllib.request.urlopen(f"{url}/lifecycle", timeout=10.0) as response:
            answer = json.loads(response.read())
    age = answer["ranks"][0]["last_heartbeat_age_s"]
    if beat[0] is None or time.time() - float(beat[0]) > 5.0:
        raise BenchError(f"the idle server's heartbeat did not keep its summary row: {beat}")
    (heartbeat_bytes,) = query(
        db, f"SELECT AVG({ROW_BYTES}) FROM events WHERE run_id = ? AND kind = 'heartbeat'", run_id
    )
    beat_bytes = float(heartbeat_bytes[0])
    seconds = ended - began
    window_bytes = sum(float(b) for _, b in rows)
    per_hour = window_bytes / seconds * 3600 + (3600 / SLOW_BEAT_S) * beat_bytes
    before = 3600 * beat_bytes  # one heartbeat row a second (the default interval)
    kinds = ", ".join(sorted({str(k) for k, _ in rows})) or "none"
    idle = Row(
        figure=f"history: journal bytes per hour per rank, `lifecycle serve` idle, {MODEL}",
        value=f"{per_hour / 1024:.1f} KiB",
        baseline=f"{before / 2**20:.2f} MiB every beat journaled",
        ratio=format_ratio(per_hour / before),
        target=verdict(f"<= 10 KiB (before: {BYTES_BEFORE})", met=per_hour <= IDLE_BYTES_TARGET),
        how=f"1 rank served idle for {seconds:.0f} s after /health 200: its rows in that time"
        f" ({len(rows)}: {kinds}) x their bytes (text plus {ROW_OVERHEAD_BYTES} for numbers"
        f" and index entries), extrapolated, plus one heartbeat row every {SLOW_BEAT_S:g} s"
        f" ({beat_bytes:.0f} bytes each, this run's mean); baseline: one such row a second."
        f" The summary row's heartbeat stayed current (/lifecycle: {age:.1f} s old at the"
        f" end); the file and its WAL changed by {size_after - size_before:+d} bytes (the"
        f" in-place updates rewrite one page in the WAL, which checkpoints keep bounded)",
    )
    return [idle, lookup]


def _file_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists())


def _journal_of_runs(db: Path, runs: int) -> str:
    """A journal at head with `runs` healthy one-rank runs spread over KEYS keys, each with its
    history row (and no events: the lookup reads only the history's index); a key to look up."""
    from lifecycle.store.journal import Journal

    Journal.open_for_write(str(db)).close()
    keys = [history_key(f"{index:016x}", StartupPath.REUSED) for index in range(KEYS)]
    t0 = 1.8e9
    conn = sqlite3.connect(db)
    try:
        with conn:
            conn.executemany(
                "INSERT INTO runs (run_id, created_at, host, world_size, config,"
                " lifecycle_version) VALUES (?, ?, 'bench', 1, '{}', 'bench')",
                ((f"run-{i:05d}", t0 + 60 * i) for i in range(runs)),
            )
            spent = json.dumps({"created": 0.01, "gate-check": 0.9, "bounded-warm": 1.2})
            conn.executemany(
                "INSERT INTO startup_history (run_id, rank, key, ready_wall, process_ready_s,"
                " durations) VALUES (?, 0, ?, ?, 4.0, ?)",
                ((f"run-{i:05d}", keys[i % KEYS], t0 + 60 * i + 5, spent) for i in range(runs)),
            )
    finally:
        conn.close()
    return keys[runs % KEYS]


def _lookup_row(settings: Settings) -> Row:
    from lifecycle.store.journal import Journal
    from lifecycle.store.learned.history import all_history, recent_history

    db = settings.workdir / "history-10k.db"
    progress(f"history: the lookup at gate-check on a journal of {JOURNAL_RUNS:,} runs")
    key = _journal_of_runs(db, JOURNAL_RUNS)
    journal = Journal.open_for_write(str(db))
    try:

        def indexed() -> float:
            started = time.perf_counter()
            with journal.engine.connect() as conn:
                expected = expect(key, runs_of(recent_history(conn, key, ranks=1).rows))
            took = time.perf_counter() - started
            if expected.runs != SAMPLE_RUNS or not expected.states:
                raise BenchError(f"the lookup found {expected.runs} runs of {key}")
            return took

        def every_row() -> float:
            started = time.perf_counter()
            with journal.engine.connect() as conn:
                mine = [r for r in all_history(conn).rows if r.key == key]
                expect(key, runs_of(mine))
            return time.perf_counter() - started

        paired = interleave(indexed, every_row, pairs=10 if settings.quick else 30, discard=1)
    finally:
        journal.close()
    value = median(paired.a)
    return compared_seconds(
        figure=f"history: lookup at gate-check, journal of {JOURNAL_RUNS:,} runs",
        value_s=value,
        baseline_s=median(paired.b),
        baseline_note=" reading every history row",
        target=verdict(f"< {LOOKUP_TARGET_S * 1e3:g} ms", met=value < LOOKUP_TARGET_S),
        how=f"SQLite journal at head (beside the idle server), {JOURNAL_RUNS:,} runs over"
        f" {KEYS} keys with a history row each; what a rank does after decide-path: connect,"
        f" read its key's newest {SAMPLE_RUNS} runs through the (key, ready_wall) index, and"
        f" compute each state's median, p95 and deadline; median of {len(paired.a)},"
        f" interleaved with the same from every row (worst {format_seconds(max(paired.a))})",
    )


def measure(settings: Settings) -> list[Row]:
    return [*_stall_rows(settings), *_idle_and_lookup(settings)]


BENCHMARK = Benchmark(name="history", measure=measure)
