"""What an idle server journals an hour, and what the history lookup at gate-check costs on a
journal of 10,000 runs (the history benchmark's last rows, bench/history.py)."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench.compare import compared_seconds
from bench.historyboots import ENV, MODEL, READY_TIMEOUT_S, kill, query, run_ids
from bench.stats import interleave, median
from bench.suite import BenchError, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict
from lifecycle.core.decisions.deadlines import (
    SAMPLE_RUNS,
    StartupPath,
    expect,
    history_key,
    runs_of,
)
from lifecycle.runtime.group.heartbeat import SLOW_BEAT_S

IDLE_BYTES_TARGET = 10 * 1024
BYTES_BEFORE = "about 1.7 MiB"
LOOKUP_TARGET_S = 0.050
JOURNAL_RUNS = 10_000
KEYS = 20  # fingerprints and paths the 10,000 runs are spread over


@contextlib.contextmanager
def serving(settings: Settings, db: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
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
        while not healthy(url):
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
            kill(proc)


def healthy(url: str) -> bool:
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


def idle_and_lookup(settings: Settings) -> list[Row]:
    """The idle server's row and, measured while it idles, the lookup's."""
    db = settings.workdir / "history-serve.db"
    window = 10.0 if settings.quick else 120.0
    progress(f"history: `lifecycle serve` idle for {window:.0f} s")
    with serving(settings, db) as (_proc, url):
        time.sleep(3.0)  # past the beat that journals the ready action's last marks
        (run_id,) = run_ids(db)[-1:]
        began = time.time()
        size_before = file_bytes(db)
        lookup = lookup_row(settings)
        time.sleep(max(0.0, window - (time.time() - began)))
        ended = time.time()
        size_after = file_bytes(db)
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


def file_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists())


def journal_of_runs(db: Path, runs: int) -> str:
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


def lookup_row(settings: Settings) -> Row:
    from lifecycle.store.journal import Journal
    from lifecycle.store.learned.history import all_history, recent_history

    db = settings.workdir / "history-10k.db"
    progress(f"history: the lookup at gate-check on a journal of {JOURNAL_RUNS:,} runs")
    key = journal_of_runs(db, JOURNAL_RUNS)
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
