"""Bad input: one clear line, a documented non-zero exit, no traceback, the file unchanged."""

from __future__ import annotations

import ast
import json
import os
import socket
import sqlite3
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.errors import FaultSpecError
from lifecycle.core.settings.faults import FaultKind, FaultSpec, parse_fault
from lifecycle.testing.journals import JournalBuilder, a2a, beat
from tests.conftest import (
    REPO,
    Completed,
    assert_refused_before_start,
    file_digest,
    make_newer_journal,
    one_clear_line,
    run_cli,
)
from tests.replay_argv import REPLAY_COMMANDS, replay_argv
from tests.support.inprocess import run_in_process


def make_truncated(path: Path) -> None:
    JournalBuilder(path, world_size=1).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2 + 100])


BAD_FILES: dict[str, tuple[Callable[[Path], object], str]] = {
    "empty": (lambda p: p.write_bytes(b""), "empty file"),
    "text": (lambda p: p.write_text("a grocery list\n"), "not a SQLite database"),
    "truncated": (make_truncated, "truncated SQLite file"),
    "foreign": (
        lambda p: sqlite3.connect(p).executescript("CREATE TABLE songs (title TEXT);"),
        "a database of another program (songs)",
    ),
    "newer": (make_newer_journal, "0999_future"),
}


def replay_cli(tmp_path: Path, *args: str) -> Completed:
    return run_cli("replay", args, cwd=tmp_path, timeout=60)


@pytest.mark.parametrize("kind", list(BAD_FILES))
@pytest.mark.parametrize("command", REPLAY_COMMANDS)
def test_replay_refuses_a_bad_file_in_one_line(
    tmp_path: Path, kind: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every replay command given a file that is not a journal it can read: exit 2, one line
    naming the file and the reason, the file's bytes unchanged (in this process: the
    refusals as real processes are test_lifecycle_refuses_a_bad_journal_in_one_line's and
    tests/replay/test_reliability_bad_input.py's)."""
    from replay.cli import main

    path = tmp_path / f"{kind}.db"
    make, reason = BAD_FILES[kind]
    make(path)
    before = file_digest(path)
    argv = replay_argv(command, path, trace=tmp_path / "t.json")
    result = run_in_process(main, argv, cwd=tmp_path, capsys=capsys)
    assert result.returncode == 2
    line = one_clear_line(result)
    assert reason in line and str(path) in line
    assert file_digest(path) == before


@pytest.mark.parametrize("kind", ["text", "truncated", "foreign", "newer"])
def test_lifecycle_refuses_a_bad_journal_in_one_line(tmp_path: Path, kind: str) -> None:
    """`lifecycle boot` and `lifecycle db upgrade` onto a file that is not its journal: exit 2,
    one line, the bytes unchanged."""
    path = tmp_path / f"{kind}.db"
    make, reason = BAD_FILES[kind]
    make(path)
    before = file_digest(path)
    for argv in (["boot", "--model", "micro-video", "--db", str(path)],
                 ["db", "upgrade", "--db", str(path)]):  # fmt: skip
        result = run_cli("lifecycle", argv, cwd=tmp_path, timeout=60)
        assert result.returncode == 2
        assert reason in one_clear_line(result)
        assert file_digest(path) == before


def test_one_bad_journal_among_good_ones_is_reported_and_skipped(tmp_path: Path) -> None:
    """A text file given beside a good journal is one warning line; the good one is read."""
    good = tmp_path / "good.db"
    JournalBuilder(good, world_size=1).rank(0).walk(0.1, "gate-check")
    bad = tmp_path / "bad.db"
    bad.write_text("not a journal")
    result = replay_cli(tmp_path, "runs", str(good), str(bad), "--json")
    assert result.returncode == 0
    assert [r["run_id"] for r in json.loads(result.stdout)] == ["run-hand-built"]
    assert one_clear_line(result).startswith("replay: warning: ")


def test_undecodable_rows_and_gaps_are_shown_not_fatal(tmp_path: Path) -> None:
    """An event whose data is not JSON, one whose data is a JSON array, a kind nobody knows,
    and a sequence gap: show and diagnose still answer, and say what they skipped."""
    db = tmp_path / "odd.db"
    b = JournalBuilder(db, world_size=1)
    b.rank(0).walk(0.1, "gate-check", "bounded-warm")
    b.rank(0).add(1.0, a2a("world", 0, ranks=(0,)))
    b.rank(0).add(2.0, beat())
    b.close()
    with sqlite3.connect(db) as conn:
        conn.executemany(
            "INSERT INTO events"
            " (run_id, rank, seq, wall_time, mono_ns, kind, version, state, data)"
            " VALUES ('run-hand-built', 0, ?, ?, 0, ?, 1, 'bounded-warm', ?)",
            [(4, 1.8e9 + 3, "heartbeat", "{not json"), (5, 1.8e9 + 4, "heartbeat", "[1, 2]"),
             (6, 1.8e9 + 5, "quantum_flux", "{}"), (9, 1.8e9 + 6, "heartbeat",
             '{"uptime_s": 1, "in_state_s": 1, "pending": null}')],
        )  # fmt: skip
    shown = replay_cli(tmp_path, "show", "latest", str(db))
    assert shown.returncode == 0, shown.stderr
    assert "3 event(s) of unknown kind or undecodable payload" in shown.stdout
    assert "sequence gaps: 7->9" in shown.stdout
    diagnosed = replay_cli(tmp_path, "diagnose", "latest", str(db), "--json")
    assert diagnosed.returncode in (0, 1, 3)  # a verdict (3: not ready, no failure), not bad input
    assert json.loads(diagnosed.stdout)["ranks"][0]["last_state"] == "bounded-warm"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--fault", "x:probe:raise"], "rank 'x' is not a non-negative integer"),
        (["--fault=-1:probe:raise"], "rank '-1' is not a non-negative integer"),
        (["--fault", "0:probe:explode"], "kind 'explode' is not one of"),
        (["--fault", "0:created:raise"], "state 'created' is not one of"),
        (["--fault", "0:probe:raise:extra"], "expected RANK:STATE:KIND"),
        (["--fault", ""], "expected RANK:STATE:KIND"),
        (["--num-ranks", "0"], "--num-ranks must be 1..64"),
        (["--num-ranks", "65", "--ulysses", "65"], "must be 1..64"),
        (["--num-ranks", "2", "--ulysses", "3", "--cfg-parallel", "1"], "must equal"),
        (["--num-ranks", "3", "--ulysses", "3"], "must divide the 4 attention heads"),
        (["--cfg-parallel", "3", "--num-ranks", "3", "--ulysses", "1"], "--cfg-parallel must be"),
        (["--heartbeat-interval", "0"], "--heartbeat-interval"),
        (["--state-deadline", "-5"], "--state-deadline"),
        (["--device", "tpu"], "invalid choice"),
        (["--smoke-request", "maybe"], "invalid choice"),
        (["--pipeline", "nowhere"], "--pipeline must be MODULE:ATTR"),
        (["--pipeline", "json:nothing_here"], "--pipeline json:nothing_here"),
        (
            ["--fault", "0:probe:raise", "--fault", "0:probe:hang"],
            "0:probe:hang: rank 0 already has fault 0:probe:raise in state 'probe'",
        ),
        (["--startup-timeout", "0"], "--startup-timeout must be in (0, 604800] seconds"),
        (["--num-ranks", "many"], "invalid int value"),
        (["--performance-mode", "turbo"], "invalid choice"),
        (["--fault", "1:nowhere:raise"], "bad fault spec"),
        (["--fault", "0:probe"], "expected RANK:STATE:KIND"),
        (["--num-ranks", "3", "--cfg-parallel", "2", "--ulysses", "2"], "must equal"),
        (["--model", "giant-video"], "is not one of"),
        (["--dist-timeout", "-1"], "--dist-timeout"),
        (["--memory-budget", "lots"], "is not a size such as 600MiB"),
        (["--memory-budget", "1MiB"], "--memory-budget must be at least 64MiB"),
        (["--memory-budget", "1e18tib"], "--memory-budget: '1e18tib' is more than 2**60 bytes"),
        (["--seed", str(2**64)], "--seed: must be an integer in 0..18446744073709551615, not"),
        (["--fault", "0:probe:over-budget"], "over-budget fires only in re-warm"),
        (
            ["--num-ranks", "2", "--fault", "1:drop-buffers:skip-collective"],
            "skip-collective never fires in drop-buffers, which runs no collective",
        ),
        (
            ["--fault", "0:gate-check:skip-collective"],
            "skip-collective never fires on one rank, which runs no collective",
        ),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad flag value is one clear line on stderr, exit 2, before anything starts: no journal
    (in this process; the same refusal from a real process is
    test_a_refused_setting_is_one_json_line_with_json_logs's)."""
    from lifecycle.serve.cli.main import main

    result = run_in_process(main, ["boot", "--db", "j.db", *flags], cwd=tmp_path, capsys=capsys)
    assert_refused_before_start(result, message, tmp_path / "j.db")


@given(text=st.text(max_size=40))
def test_the_fault_parser_only_ever_raises_fault_spec_error(text: str) -> None:
    """Any string parses to a FaultSpec or is refused with FaultSpecError, nothing else."""
    try:
        spec = parse_fault(text)
    except FaultSpecError as exc:
        message = str(exc)
    else:
        assert parse_fault(str(spec)) == spec
        return
    assert "\n" not in message


@given(
    rank=st.integers(min_value=0, max_value=10**6),
    state=st.sampled_from(
        ["gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"]
    ),
    kind=st.sampled_from([k.value for k in FaultKind]),
)
def test_well_formed_specs_round_trip(rank: int, state: str, kind: str) -> None:
    """RANK:STATE:KIND parses to exactly those values, and prints back the same (over-budget
    only where it fires, in re-warm, and skip-collective only where a collective runs; anywhere
    else each is refused in one line)."""
    if kind == FaultKind.OVER_BUDGET.value and state != "re-warm":
        with pytest.raises(FaultSpecError, match="over-budget fires only in re-warm"):
            parse_fault(f" {rank}:{state}:{kind} ")
        return
    if kind == FaultKind.SKIP_COLLECTIVE.value and state == "drop-buffers":
        with pytest.raises(FaultSpecError, match="never fires in drop-buffers"):
            parse_fault(f" {rank}:{state}:{kind} ")
        return
    spec = parse_fault(f" {rank}:{state}:{kind} ")
    assert isinstance(spec, FaultSpec)
    assert (spec.rank, spec.state.value, spec.kind.value) == (rank, state, kind)
    assert str(spec) == f"{rank}:{state}:{kind}"


def test_a_number_replay_cannot_hold_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """`show --last` past 64 bits (SQLite's integers): one line, exit 2 (bad input), not a
    traceback and exit 1, which reads as the "failed" verdict."""
    db = tmp_path / "j.db"
    builder = JournalBuilder(db, world_size=1)
    builder.rank(0).walk(0.1, "gate-check")
    builder.close()
    result = replay_cli(tmp_path, "show", "latest", str(db), "--last", str(2**80))
    assert result.returncode == 2
    assert one_clear_line(result).startswith("replay: error: the input holds too large a number")


QUIET_BOOT = ["boot", "--model", "micro-video", "--log-level", "error"]


@pytest.mark.parametrize("name", [pytest.param("a?1.db", marks=pytest.mark.slow), "x%41.db"])
def test_a_journal_path_is_a_path_whatever_characters_it_holds(tmp_path: Path, name: str) -> None:
    """`--db` with `?` or `%` in it writes a file of exactly that name (not `a`, not `xA.db`),
    and replay reads it back by that name."""
    result = run_cli("lifecycle", [*QUIET_BOOT, "--db", name], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == [name]
    runs = replay_cli(tmp_path, "runs", name, "--json")
    assert runs.returncode == 0, runs.stderr
    assert [run["outcome"] for run in json.loads(runs.stdout)] == ["ready"]


def special_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "j.db"
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        try:  # a /dev/null of our own, so that a sidecar file would land in tmp_path
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            return Path("/dev/null")
    return path


@pytest.mark.parametrize("kind", ["character device", "FIFO", "directory"])
@pytest.mark.parametrize("program", ["boot", "replay"])
def test_a_journal_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, kind: str, program: str
) -> None:
    """A device, a FIFO or a directory as the journal: exit 2, one line saying what it is,
    and no -journal, -wal or -shm file created beside it."""
    path = special_file(tmp_path, kind)
    if program == "boot":
        result = run_cli("lifecycle", [*QUIET_BOOT, "--db", str(path)], cwd=tmp_path, timeout=60)
    else:
        result = replay_cli(tmp_path, "runs", str(path))
    assert result.returncode == 2
    assert one_clear_line(result).endswith(
        f"{path}: not a lifecycle journal: not a regular file (a {kind})"
    )
    for suffix in ("-journal", "-wal", "-shm"):
        assert not path.with_name(path.name + suffix).exists()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("garbage://x", ["garbage://x: no database dialect 'garbage' is installed"]),
        pytest.param(
            "mysql+pymysql://u@h/db",
            ["driver 'pymysql' for 'mysql+pymysql' is not installed", "pip install 'PyMySQL'"],
            marks=pytest.mark.slow,
        ),
        (
            "postgresql+psycopg2://u:secret@h/db",
            ["postgresql+psycopg2://u:***@h/db: the database driver", "pip install"],
        ),
        # psycopg 3 (the postgres extra, installed with the tests): a host that is not there.
        ("postgresql://u:secret@h/db", ["postgresql://u:***@h/db: failed to resolve host 'h'"]),
    ],
)
def test_a_database_url_that_cannot_be_used_is_one_line(
    tmp_path: Path, url: str, expected: list[str]
) -> None:
    """`--db`, `LIFECYCLE_DB` and replay given a URL of an unknown database, or of a driver
    that is not installed: exit 2, one line naming what to install, never the password."""
    for result in (
        run_cli("lifecycle", [*QUIET_BOOT, "--db", url], cwd=tmp_path, timeout=60),
        run_cli("lifecycle", QUIET_BOOT, cwd=tmp_path, timeout=60, env={"LIFECYCLE_DB": url}),
        replay_cli(tmp_path, "runs", url),
    ):
        assert result.returncode == 2
        line = one_clear_line(result)
        assert all(fragment in line for fragment in expected), line
        assert "secret" not in result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_file_name_too_long_is_one_short_line(tmp_path: Path) -> None:
    """A 5,000-character journal name: boot and replay exit 2 with one short line."""
    name = "j" * 5000 + ".db"
    for result in (
        run_cli("lifecycle", [*QUIET_BOOT, "--db", name], cwd=tmp_path, timeout=60),
        replay_cli(tmp_path, "runs", name),
    ):
        assert result.returncode == 2
        line = one_clear_line(result)
        assert line.endswith("(5003 characters): cannot be opened: file name too long"), line
        assert len(line) < 200
    assert list(tmp_path.iterdir()) == []


def test_torchrun_environment_with_a_busy_master_port_is_one_line(tmp_path: Path) -> None:
    """RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, with the port already taken: exit 2,
    one line naming the address and the cause, and no journal written."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        result = run_cli(
            "lifecycle",
            [*QUIET_BOOT, "--num-ranks", "2", "--db", "j.db", "--dist-timeout", "5"],
            cwd=tmp_path,
            timeout=120,
            env=env,
        )
    assert result.returncode == 2
    assert one_clear_line(result) == (
        f"lifecycle: error: cannot join the process group at 127.0.0.1:{port}"
        " (MASTER_ADDR:MASTER_PORT): address already in use"
    )
    assert list(tmp_path.iterdir()) == []


def test_torchrun_environment_that_is_not_numbers_is_one_line(tmp_path: Path) -> None:
    """A torchrun-style environment whose RANK is not a number: exit 2, one line quoting it."""
    env = {"RANK": "zero", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    result = run_cli(
        "lifecycle", [*QUIET_BOOT, "--num-ranks", "2", "--db", "j.db"], cwd=tmp_path,
        timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2
    assert "must be integers (as torchrun sets them), not RANK='zero'" in one_clear_line(result)
    assert list(tmp_path.iterdir()) == []


# Every module that reads journal content: replay, the store, and the core that decodes and
# folds it (every folder below them, so that a new module is covered the day it is added).
READ_PATH_MODULES = sorted(
    path
    for folder in (REPO / "replay", REPO / "lifecycle" / "store", REPO / "lifecycle" / "core")
    for path in folder.rglob("*.py")
)


@pytest.mark.parametrize("module", READ_PATH_MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_journal_content_is_never_unpickled_or_evaluated(module: Path) -> None:
    """The code that reads journals imports no pickle or marshal and calls no eval or exec."""
    tree = ast.parse(module.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert not imported & {"pickle", "marshal", "shelve", "dill", "cloudpickle"}
    calls = {
        node.func.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert not calls & {"eval", "exec", "compile", "__import__"}


@pytest.mark.parametrize(
    ("flags", "config", "message"),
    [
        (["--num-ranks", "0"], None, "--num-ranks must be 1..64"),
        (["--seed", "nope"], None, "invalid int value"),
        (["--config", "c.toml"], "num-ranks = [\n", "--config c.toml"),
        (["--config", "c.toml"], "memory_budget = 1000\n", "memory_budget must be at least"),
    ],
)
def test_a_refused_setting_is_one_json_line_with_json_logs(
    tmp_path: Path, flags: list[str], config: str | None, message: str
) -> None:
    """With --json-logs a refused flag, config file or setting is one JSON line on stderr (the
    error event with its words in `text`), exit 2, as every other line then is."""
    if config is not None:
        (tmp_path / "c.toml").write_text(config)
    result = run_cli(
        "lifecycle", ["boot", "--json-logs", "--db", "j.db", *flags], cwd=tmp_path, timeout=60
    )
    assert result.returncode == 2
    record = json.loads(one_clear_line(result))
    assert record["event"] == "error"
    assert record["level"] == "error"
    assert record["exit_status"] == 2
    assert message in record["text"]
    assert record["text"].startswith("lifecycle")
    assert not (tmp_path / "j.db").exists()
