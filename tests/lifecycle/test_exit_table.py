"""One exit table per command: `lifecycle` (boot, serve, db, first-run and the rank processes)
reads its statuses from `lifecycle.core.command.Exit`, `replay` from `replay.exits.ReplayExit`;
an error that reaches a command's top carries its status; the default journal is spelled once
(see docs/architecture.md)."""

from __future__ import annotations

import ast
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from lifecycle.core.command import DEFAULT_JOURNAL, JOURNAL_ENV, Exit, OneLineParser
from lifecycle.core.errors import ConfigError, JournalError, JournalWriteFailed, LifecycleError
from replay.exits import AmbiguousRun, ReplayError, ReplayExit, RunNotFound, Usage
from tests.conftest import REPO, one_clear_line, run_cli

ROOT = Path(__file__).resolve().parents[2]
TABLES = {ROOT / "lifecycle/core/command.py", ROOT / "replay/exits.py"}


def product_modules() -> Iterator[tuple[Path, ast.Module]]:
    for package in ("lifecycle", "replay"):
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_no_module_but_the_tables_defines_an_exit_status() -> None:
    """No `EXIT_*` constant outside the two tables: a status is a member of its command's."""
    defined = [
        f"{path.relative_to(ROOT)}:{node.lineno} {target.id}"
        for path, tree in product_modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and re.fullmatch(r"EXIT_[A-Z_]+", target.id)
    ]
    assert defined == []


def test_one_argparse_error_override_serves_both_commands() -> None:
    """Only OneLineParser overrides ArgumentParser.error; replay's parser derives from it."""
    overrides = [
        f"{path.relative_to(ROOT)}:{node.name}"
        for path, tree in product_modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        for item in node.body
        if isinstance(item, ast.FunctionDef) and item.name == "error"
    ]
    assert overrides == ["lifecycle/core/command.py:OneLineParser"]


def test_the_default_journal_is_spelled_once() -> None:
    """'lifecycle.db' and 'LIFECYCLE_DB' as literals only in lifecycle/core/command.py."""
    spelled = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path, tree in product_modules()
        if path not in TABLES
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in (DEFAULT_JOURNAL, JOURNAL_ENV)
    ]
    assert spelled == []


def test_errors_carry_their_exit_status() -> None:
    """As click's exceptions do: bad input 2, a journal that cannot be written 3; replay's
    errors live in replay and end a command with its bad-input status."""
    assert ConfigError("x").exit_status is Exit.USAGE
    assert JournalError("x").exit_status is Exit.USAGE
    assert JournalWriteFailed(location="j.db", reason="disk full").exit_status is Exit.UNJOURNALED
    for error in (ReplayError("x"), Usage("x"), RunNotFound(ref="r", known=0),
                  AmbiguousRun(ref="r", candidates=["ra", "rb"])):  # fmt: skip
        assert isinstance(error, LifecycleError)
        assert error.exit_status == ReplayExit.BAD_INPUT
    assert issubclass(Usage, ReplayError)
    assert OneLineParser.usage_status == Exit.USAGE


@pytest.mark.parametrize("command", ["boot", "serve"])
def test_each_help_lists_exactly_the_table(tmp_path: Path, command: str) -> None:
    """`lifecycle boot|serve --help` lists every status of the table, and no other (boot
    also 128+N, for a rank ended by a signal)."""
    result = run_cli("lifecycle", [command, "--help"], cwd=tmp_path, timeout=60)
    assert result.returncode == Exit.OK
    epilog = result.stdout.split("exit status:", 1)[1]
    listed = {int(m) for m in re.findall(r"^  (\d+) ", epilog, flags=re.MULTILINE)}
    assert listed == set(Exit)
    assert ("128+N" in epilog) is (command == "boot")


def test_a_foreign_file_and_a_bad_config_end_with_the_usage_status(tmp_path: Path) -> None:
    """Bad input reaching `lifecycle db` and `lifecycle boot`: one line, the table's 2."""
    (tmp_path / "foreign.db").write_bytes(b"not sqlite at all" * 64)
    result = run_cli("lifecycle", ["db", "current", "--db", "foreign.db"], cwd=tmp_path)
    assert result.returncode == Exit.USAGE
    assert one_clear_line(result).startswith("lifecycle: error: ")
    result = run_cli(
        "lifecycle", ["boot", "--model", "micro-video", "--num-ranks", "0"], cwd=tmp_path
    )
    assert result.returncode == Exit.USAGE
    assert one_clear_line(result).startswith("lifecycle: error: ")


def test_no_two_modules_of_lifecycle_share_a_name() -> None:
    """A module's file name says which one it is (docs/architecture.md): no two files of the
    lifecycle package share one, whatever their folder."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "lifecycle").rglob("*.py")):
        if path.name != "__init__.py":
            seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_every_refusal_of_lifecycle_starts_with_one_prefix(tmp_path: Path) -> None:
    """A flag argparse refuses (of `boot`, of `db copy`), a --db URL of no installed database
    and a journal of a newer schema are each one line starting `lifecycle: error: `, the form
    of every other refusal, never `lifecycle boot: error: `."""
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('9999')")
    conn.close()
    refusals = {
        "a bad flag value": ["boot", "--model", "micro-video", "--num-ranks", "x"],
        "a missing flag": ["db", "copy", "--db", "j.db"],
        "a bad --db URL": ["boot", "--model", "micro-video", "--db", "nosuch://x"],
        "a newer journal": ["boot", "--model", "micro-video", "--db", str(newer)],
    }
    lines = {}
    for what, args in refusals.items():
        result = run_cli("lifecycle", args, cwd=tmp_path, timeout=60)
        assert result.returncode == Exit.USAGE, (what, result.stderr)
        lines[what] = one_clear_line(result)
    assert {what: line.split(": error: ")[0] for what, line in lines.items()} == dict.fromkeys(
        refusals, "lifecycle"
    ), lines
    assert "argument --num-ranks/--num-gpus: invalid int value: 'x'" in lines["a bad flag value"]
    assert "newer lifecycle" in lines["a newer journal"]
