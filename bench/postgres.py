"""The journal on PostgreSQL beside SQLite: one append against raw psycopg on the same server,
and appends from 1, 2, 4 and 8 processes into one database against one SQLite file.

The server is a throwaway cluster started the way the tests start theirs (tests/pg.py:
Debian's initdb and pg_ctl, on a free loopback port); without those binaries the rows say
so instead of a figure.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from bench.journal import (
    PROCESS_COUNTS,
    RUN_ID,
    TIMEOUT_S,
    RawRow,
    _append_in_processes,
    interleaved_appends,
    latency_compared,
    new_journal,
)
from bench.procs import Pool
from bench.stats import median
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, format_ratio, verdict

if TYPE_CHECKING:
    from tests.pg import PostgresServer

INSERT = (
    "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state, data)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
)
_names = itertools.count()


def _database(server: PostgresServer, stem: str) -> str:
    url = server.create_database(f"bench_{stem}_{next(_names)}")
    new_journal(url, run_id=RUN_ID, world_size=max(PROCESS_COUNTS))
    return url


def latency_rows(settings: Settings, server: PostgresServer) -> list[Row]:
    import psycopg

    pairs = 200 if settings.quick else 2000
    discard = 20 if settings.quick else 100
    progress(f"postgres: append latency, {pairs} interleaved pairs")
    lifecycle_url = _database(server, "latency")
    raw_url = _database(server, "raw")
    with psycopg.connect(server.dsn(raw_url.rsplit("/", 1)[1])) as raw:

        def raw_psycopg(row: RawRow) -> None:
            raw.execute(INSERT, row)
            raw.commit()

        paired = interleaved_appends(lifecycle_url, raw_psycopg, pairs=pairs, discard=discard)
    how = (
        f"{pairs} appends each side, interleaved one by one ({discard} pairs discarded), into"
        " two databases of one local PostgreSQL server made by the same migrations"
        " (fsync off: the server's own floor, not the disk's); lifecycle: RankWriter.append"
        " of an action_started event (JSON encoding and the rank's summary row included);"
        " raw: psycopg 3 INSERT of the same row, pre-encoded, then COMMIT"
    )
    return latency_compared(paired, figure="journal append latency on PostgreSQL", how=how)


def throughput_rows(settings: Settings, server: PostgresServer) -> list[Row]:
    events = 300 if settings.quick else 2000
    template = settings.workdir / "pg-procs-template.db"
    new_journal(template, run_id=RUN_ID, world_size=max(PROCESS_COUNTS))
    rows = []
    with Pool(
        "bench.journal", size=max(PROCESS_COUNTS), workdir=settings.workdir, timeout_s=TIMEOUT_S
    ) as pool:
        for processes in PROCESS_COUNTS:
            progress(f"postgres: {processes} process(es) x {events} appends")
            url = _database(server, f"procs{processes}")
            results = pool.round(
                [{"db": url, "rank": i, "events": events} for i in range(processes)]
            )
            appended = sum(int(r["appended"]) for r in results)
            span = max(float(r["finished"]) for r in results) - min(
                float(r["started"]) for r in results
            )
            rate = appended / span if span > 0 else 0.0
            errors = sum(int(r["lock_errors"]) + int(r["other_errors"]) for r in results)
            sqlite = _append_in_processes(
                settings, pool, template, processes=processes, shared=True, events=events,
                tag=f"pg-{processes}",
            )  # fmt: skip
            lost = processes * events - _read_back(url)
            rows.append(
                Row(
                    figure=f"journal append throughput on PostgreSQL, {processes} process(es)",
                    value=f"{rate:,.0f} events/s (one database)",
                    baseline=f"{sqlite.events_per_s:,.0f} events/s (one SQLite file)",
                    ratio=format_ratio(rate / sqlite.events_per_s),
                    target=verdict(
                        f"0 lost, 0 errors (lost {lost}, errors {errors})",
                        met=lost == 0 and errors == 0,
                    ),
                    how=(
                        f"{processes} worker process(es) x {events} durable appends"
                        " (RankWriter.append, one rank each) into one database, released"
                        " together; events/s = all appended / (last finish - first start);"
                        " beside the same into one SQLite file, in the same run"
                    ),
                )
            )
    return rows


def diagnose_rows(settings: Settings, server: PostgresServer) -> list[Row]:
    """`replay diagnose` on PostgreSQL copies of bench.replay's synthetic journals, beside
    the same journals read from SQLite, in the same run."""
    from bench.replay import RANKS, journal_of, timed
    from lifecycle.store.journal import Journal
    from lifecycle.store.upkeep.copy import copy_journal

    small, large = (10_000, 30_000) if settings.quick else (10_000, 1_000_000)
    rounds = 1 if settings.quick else 3
    urls: dict[int, str] = {}
    for size in (small, large):
        source = journal_of(settings, size)
        url = server.create_database(f"bench_diagnose_{size}")
        progress(f"postgres: copying the {size:,}-event journal into PostgreSQL")
        with Journal.open_for_read(str(source)) as src, Journal.open_for_write(url) as into:
            copy_journal(src, into, run_ids=None)
        urls[size] = url
    seconds: dict[tuple[str, int], list[float]] = {}
    for index in range(rounds):
        for size in (small, large) if index % 2 == 0 else (large, small):
            for name, where in (("pg", urls[size]), ("sqlite", str(journal_of(settings, size)))):
                took = timed(["diagnose", "latest", where, "--json"], cwd=settings.workdir)
                seconds.setdefault((name, size), []).append(took.seconds)
    best = {key: median(values) for key, values in seconds.items()}
    how = (
        f"`replay diagnose latest URL --json` in a child process on PostgreSQL copies (lifecycle"
        f" db copy) of bench.replay's synthetic {RANKS}-rank journals, beside the same"
        f" journals in SQLite; median of {rounds}, sizes and stores interleaved"
    )
    return [
        Row(
            figure=f"replay diagnose on PostgreSQL, {size:,} events ({RANKS} ranks)",
            value=f"{best[('pg', size)] * 1000:,.0f} ms",
            baseline=f"{best[('sqlite', size)] * 1000:,.0f} ms on SQLite",
            ratio=format_ratio(best[("pg", size)] / best[("sqlite", size)]),
            target=verdict("< 2 s", met=best[("pg", size)] < 2.0),
            how=how,
        )
        for size in (small, large)
    ]


def _read_back(url: str) -> int:
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(url) as journal:
        return sum(1 for _ in journal.read(run_id=RUN_ID))


def measure(settings: Settings) -> list[Row]:
    from tests.pg import bindir, postgres_server

    try:
        bindir()
    except RuntimeError as exc:
        return [Row(figure="journal on PostgreSQL", value="not measured", how=str(exc))]
    with postgres_server() as server:
        return [
            *latency_rows(settings, server),
            *throughput_rows(settings, server),
            *diagnose_rows(settings, server),
        ]


BENCHMARK = Benchmark(name="postgres", measure=measure)
