"""Bad input: one clear line, a documented non-zero exit, no traceback, the file unchanged."""

from __future__ import annotations

import ast
import json
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.errors import FaultSpecError
from lifecycle.faults import FaultKind, FaultSpec, parse_fault
from tests.conftest import REPO, Completed, file_digest, make_newer_journal, run_cli
from tests.replay.builder import JournalBuilder, a2a, beat


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


def one_clear_line(result: Completed) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("kind", list(BAD_FILES))
@pytest.mark.parametrize("command", ["runs", "diagnose", "show", "verify", "trace", "diff"])
def test_replay_refuses_a_bad_file_in_one_line(tmp_path: Path, kind: str, command: str) -> None:
    """Every replay command given a file that is not a journal it can read: exit 2, one line
    naming the file and the reason, the file's bytes unchanged."""
    path = tmp_path / f"{kind}.db"
    make, reason = BAD_FILES[kind]
    make(path)
    before = file_digest(path)
    argv = {
        "runs": ["runs", str(path)],
        "diagnose": ["diagnose", "latest", str(path)],
        "show": ["show", "latest", str(path)],
        "verify": ["verify", "--all", str(path)],
        "trace": ["trace", "latest", str(path), "-o", str(tmp_path / "t.json")],
        "diff": ["diff", "latest", "latest", str(path)],
    }[command]
    result = replay_cli(tmp_path, *argv)
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
        result = run_cli("lifecycle.cli", argv, cwd=tmp_path, timeout=60)
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
            "INSERT INTO events VALUES ('run-hand-built', 0, ?, ?, 0, ?, 1, 'bounded-warm', ?)",
            [(4, 1.8e9 + 3, "heartbeat", "{not json"), (5, 1.8e9 + 4, "heartbeat", "[1, 2]"),
             (6, 1.8e9 + 5, "quantum_flux", "{}"), (9, 1.8e9 + 6, "heartbeat",
             '{"uptime_s": 1, "in_state_s": 1, "pending": null}')],
        )  # fmt: skip
    shown = replay_cli(tmp_path, "show", "latest", str(db))
    assert shown.returncode == 0, shown.stderr
    assert "3 event(s) of unknown kind or undecodable payload" in shown.stdout
    assert "sequence gaps: 7->9" in shown.stdout
    diagnosed = replay_cli(tmp_path, "diagnose", "latest", str(db), "--json")
    assert diagnosed.returncode in (0, 1)
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
    ],
)
def test_bad_flags_are_one_line_and_exit_2(tmp_path: Path, flags: list[str], message: str) -> None:
    """Malformed fault specs and out-of-range rank counts are refused before anything starts."""
    result = run_cli("lifecycle.cli", ["boot", "--db", "j.db", *flags], cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert message in one_clear_line(result)
    assert not (tmp_path / "j.db").exists()


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
    """RANK:STATE:KIND parses to exactly those values, and prints back the same."""
    spec = parse_fault(f" {rank}:{state}:{kind} ")
    assert isinstance(spec, FaultSpec)
    assert (spec.rank, spec.state.value, spec.kind.value) == (rank, state, kind)
    assert str(spec) == f"{rank}:{state}:{kind}"


READ_PATH_MODULES = [
    *sorted((REPO / "replay").glob("*.py")),
    REPO / "lifecycle" / "journal.py",
    REPO / "lifecycle" / "events.py",
    REPO / "lifecycle" / "fold.py",
]


@pytest.mark.parametrize("module", READ_PATH_MODULES, ids=lambda p: p.name)
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
