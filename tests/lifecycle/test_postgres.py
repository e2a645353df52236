"""PostgreSQL as the fleet's journal, against a real server the tests start (tests/pg.py):
real ranks write to it, replay reads it, and its password appears nowhere."""

from __future__ import annotations

import itertools
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from lifecycle.serve.ranks.supervisor import free_port
from tests.conftest import reaped, run_cli
from tests.pg import PASSWORD, PostgresServer
from tests.support.interpreter import run_python

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]
_names = itertools.count()
MICRO = ["--model", "micro-video", "--heartbeat-interval", "0.2", "--log-level", "info"]


def database(postgres: PostgresServer) -> str:
    return postgres.create_database(f"pg_{next(_names)}")


def everything_said(
    url: str, tmp_path: Path, *outputs: subprocess.CompletedProcess[str]
) -> tuple[str, int]:
    """What a person or a program could see of the journal: the commands' outputs, replay's
    answers in text and JSON, a trace, and every row of every table (and how many rows)."""
    rows = 0
    said = [o.stdout + o.stderr for o in outputs]
    for argv in (["runs", url], ["runs", url, "--json"], ["show", "latest", url, "--json"],
                 ["show", "latest", url, "--all"], ["diagnose", "latest", url, "--json"],
                 ["trace", "latest", url, "-o", "-"]):  # fmt: skip
        done = run_cli("replay", argv, cwd=tmp_path)
        said.append(done.stdout + done.stderr)
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    with engine.connect() as conn:
        for table in ("runs", "events", "rank_summaries", "rank_checkpoints"):
            found = [str(row) for row in conn.execute(text(f"SELECT * FROM {table}"))]
            rows += len(found)
            said.extend(found)
    engine.dispose()
    return "\n".join(said), rows


def test_ranks_journal_to_postgres_and_the_password_appears_nowhere(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """Two ranks boot to ready on PostgreSQL with JSON logs; replay reads it back ready; the
    password is in no output, log line, journal row, replay answer or trace."""
    url = database(postgres)
    booted = run_cli(
        "lifecycle", ["boot", *MICRO, "--num-ranks", "2", "--db", url, "--json-logs"],
        cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert booted.returncode == 0, booted.stderr[-2000:]
    assert "postgresql://lifecycle:***@" in booted.stdout
    # Every line JSON, the launcher's table, its rank summaries and its result included.
    said = [json.loads(line) for line in (booted.stdout + booted.stderr).splitlines()]
    assert [line["exit_status"] for line in said if line["event"] == "boot-result"] == [0]
    assert len([line for line in said if line["event"] == "rank-summary"]) == 2
    diagnosed = run_cli("replay", ["diagnose", "latest", url, "--json"], cwd=tmp_path)
    assert json.loads(diagnosed.stdout)["outcome"] == "ready"
    said, rows = everything_said(url, tmp_path, booted, diagnosed)
    assert rows > 50 and "collective_started" in said
    assert PASSWORD not in said


@pytest.mark.parametrize(
    ("layout", "fault", "outcome"),
    [
        pytest.param(
            ["--num-ranks", "4", "--cfg-parallel", "2", "--on-peer-failure", "wait"],
            "1:drop-buffers:raise",
            "hung",
            marks=pytest.mark.slow,
        ),
        pytest.param(["--num-ranks", "2"], "1:probe:exit", "crashed", marks=pytest.mark.slow),
    ],
)
def test_the_fields_failure_and_a_crash_are_diagnosed_from_postgres(
    postgres: PostgresServer, tmp_path: Path, layout: list[str], fault: str, outcome: str
) -> None:
    """The field's failure on 4 ranks (an error in drop-buffers, peers left in the next
    all-to-all, waiting as the field's did) and a rank that dies in probe, journaled to
    PostgreSQL: the verdicts SQLite gives."""
    url = database(postgres)
    run_cli(
        "lifecycle",
        ["boot", *MICRO, *layout, "--calibrate", "--db", url, "--fault", fault,
         "--dist-timeout", "5"],
        cwd=tmp_path, timeout=180,
    )  # fmt: skip
    done = run_cli("replay", ["diagnose", "latest", url, "--json"], cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert (doc["outcome"], doc["culprit_ranks"]) == (outcome, [1]), done.stdout
    assert PASSWORD not in done.stdout + done.stderr


def test_bad_urls_are_one_line_without_the_password(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """A wrong password, a server that is not there, a database that does not exist, a driver
    that is not installed: one line on stderr, exit 2, and never the password."""
    nobody = f"postgresql://lifecycle:{PASSWORD}@127.0.0.1:{free_port()}/j"
    cases = {
        "password": postgres.url("postgres", password=PASSWORD + "x"),
        "unreachable": nobody,
        "no database": postgres.url("no_such_db"),
        "driver": postgres.url("postgres", scheme="postgresql+psycopg2"),
    }
    for name, url in cases.items():
        for module, argv in (("lifecycle", ["boot", "--db", url]), ("replay", ["runs", url])):
            done = run_cli(module, argv, cwd=tmp_path, timeout=60)
            lines = done.stderr.strip().splitlines()
            assert done.returncode == 2, (name, module, done.stderr)
            assert len(lines) == 1, (name, module, done.stderr)
            assert PASSWORD not in done.stdout + done.stderr, (name, module)
            if name == "driver":
                assert "pip install 'psycopg2-binary'" in lines[0]


def test_without_psycopg_a_postgres_url_names_the_extra(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """psycopg not importable (as where the `postgres` extra is not installed): one line
    naming the extra to install, exit 2."""
    url = postgres.url("postgres")
    entry = (
        "import sys; sys.modules['psycopg'] = None; from lifecycle.serve.cli.main import main;"
        f" sys.exit(main(['boot', '--db', {url!r}]))"
    )
    done = run_python(entry, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "lifecycle: error: postgresql://lifecycle:***@127.0.0.1:"
        f"{postgres.port}/postgres: the database driver 'psycopg' for 'postgresql+psycopg' is"
        " not installed: pip install 'diffusion-lifecycle[postgres]'"
    ]


@pytest.mark.slow
def test_a_node_journal_is_copied_into_postgres_and_reads_the_same(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """`lifecycle db copy` fills the fleet's database from a node's SQLite file: every event
    with its seq, state and times; the verdict read from either is the same; a second copy
    leaves what is there alone and says so."""
    node = tmp_path / "node.db"
    failed = ["--num-ranks", "2", "--fault", "1:bounded-warm:raise", "--dist-timeout", "5"]
    for extra in ([], failed):
        run_cli("lifecycle", ["boot", *MICRO, "--db", str(node), *extra], cwd=tmp_path, timeout=180)
    url = database(postgres)
    # The node's file as it was part way through its second run: rank 0 had written 12 events.
    early = tmp_path / "early.db"
    with sqlite3.connect(node) as source, sqlite3.connect(early) as copy:
        source.backup(copy)
    with sqlite3.connect(early) as conn:
        (second,) = conn.execute("SELECT max(run_id) FROM runs").fetchone()
        conn.execute("DELETE FROM events WHERE run_id = ? AND rank = 0 AND seq > 11", (second,))
    first = run_cli("lifecycle", ["db", "copy", "--db", str(early), "--to", url], cwd=tmp_path)
    assert "of 3 rank(s) in 2 run(s)" in first.stdout, first.stderr
    copied = run_cli("lifecycle", ["db", "copy", "--db", str(node), "--to", url], cwd=tmp_path)
    assert copied.returncode == 0, copied.stderr
    (line,) = copied.stdout.strip().splitlines()
    assert "of 1 rank(s) in 1 run(s) (1 of them completed" in line, line
    assert "2 rank(s) already there" in line and PASSWORD not in line
    runs = json.loads(run_cli("replay", ["runs", str(node), "--json"], cwd=tmp_path).stdout)
    assert [r["outcome"] for r in runs] == ["ready", "failed"]
    for run in runs:
        argv = ["diagnose", run["run_id"]]
        here = run_cli("replay", [*argv, str(node), "--json"], cwd=tmp_path)
        there = run_cli("replay", [*argv, url, "--json"], cwd=tmp_path)
        assert json.loads(here.stdout) == json.loads(there.stdout)
    node_show = run_cli("replay", ["show", "latest", str(node), "--all"], cwd=tmp_path).stdout
    copy_show = run_cli("replay", ["show", "latest", url, "--all"], cwd=tmp_path).stdout
    assert node_show.splitlines()[1:] == copy_show.splitlines()[1:]
    again = run_cli("lifecycle", ["db", "copy", "--db", str(node), "--to", url], cwd=tmp_path)
    assert "copied 0 events of 0 rank(s) in 0 run(s); 3 rank(s) already there" in again.stdout


def test_the_server_going_away_mid_run_is_one_line_and_loses_nothing(tmp_path: Path) -> None:
    """A rank hangs in bounded-warm, heartbeating into PostgreSQL; the server is stopped at
    once under it. The rank's next write fails: one line, exit 3 (the journal could not be
    written). Started again, the server holds every event the rank committed before."""
    from lifecycle.store.journal import Journal
    from tests.pg import postgres_server

    with postgres_server() as server:
        url = server.create_database("goes_away")
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "boot", *MICRO, "--db", url,
             "--fault", "0:bounded-warm:hang", "--log-level", "error"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with reaped(proc):
            seen = _wait_for_heartbeats(url, at_least=5, within=60)
            server.stop()
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == 3, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        (line,) = lines
        assert line.startswith("lifecycle: error: journal postgresql://lifecycle:***@"), line
        assert "could not be written" in line and PASSWORD not in line
        server.resume()
        with Journal.open_for_read(url) as journal:
            (run,) = journal.runs()
            kept = [e.seq for e in journal.read(run_id=run.run_id)]
        assert kept == list(range(len(kept))) and len(kept) >= seen


def _wait_for_heartbeats(url: str, *, at_least: int, within: float) -> int:
    """How many events the run has once it has `at_least` heartbeats."""
    import time

    from lifecycle.core.errors import JournalError
    from lifecycle.store.journal import Journal

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with Journal.open_for_read(url) as journal:
                runs = journal.runs()
                stored = list(journal.read(run_id=runs[0].run_id)) if runs else []
        except JournalError:
            stored = []
        if sum(e.kind == "heartbeat" for e in stored) >= at_least:
            return len(stored)
        time.sleep(0.2)
    raise AssertionError(f"fewer than {at_least} heartbeats within {within} s")


def test_a_role_that_may_not_create_tables_is_one_line(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """A login that may connect but not create the journal's tables: one line naming the
    lack of privilege, exit 2, no password, and nothing created."""
    import psycopg

    url = database(postgres)
    name = url.rsplit("/", 1)[1]
    with psycopg.connect(postgres.dsn(name), autocommit=True) as conn:
        conn.execute("CREATE ROLE reader LOGIN PASSWORD 'reader-pw-42'")
    guest = url.replace(f"lifecycle:{PASSWORD}@", "reader:reader-pw-42@")
    done = run_cli("lifecycle", ["boot", *MICRO, "--db", guest], cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("lifecycle: error: postgresql://reader:***@"), line
    assert "permission denied" in line and "reader-pw-42" not in done.stdout + done.stderr
    with psycopg.connect(postgres.dsn(name)) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        ).fetchone()
    assert tables == (0,)
