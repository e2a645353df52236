"""replay explains itself (--version, --help: RUN, JOURNAL, exit statuses) and reads the journal
`lifecycle boot` writes by default when none is named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lifecycle
from lifecycle.core.format.events import Error
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder
from replay.cli import main
from replay.exits import ReplayExit
from tests.conftest import bash_completions
from tests.support.interpreter import run_python

COMMANDS_WITH_RUN = ("show", "diagnose", "verify", "trace", "diff")


def help_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `replay ARGV... --help` prints; it exits 0."""
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--help"])
    assert stopped.value.code == 0
    return capsys.readouterr().out


def exit_statuses(text: str) -> set[int]:
    """The statuses listed under "exit status:" in a help text."""
    listed = text.split("exit status:\n", 1)[1]
    return {int(code) for code in re.findall(r"^  (\d)  ", listed, flags=re.MULTILINE)}


def test_version_names_the_lifecycle_version_without_importing_torch() -> None:
    """`replay --version` prints `replay (lifecycle X.Y.Z)`, exits 0, and leaves torch out."""
    code = (
        "import sys\n"
        "from replay.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"replay (lifecycle {lifecycle.__version__})\n"


def test_help_says_what_run_and_journal_are(capsys: pytest.CaptureFixture[str]) -> None:
    """`replay --help`: RUN is an id, a unique prefix or latest; JOURNAL a path or URL, several
    merged, $LIFECYCLE_DB or ./lifecycle.db by default; and NO_COLOR."""
    text = help_of(capsys)
    for words in ("unique prefix", "'latest'", "SQLite file path", "SQLAlchemy URL", "merged",
                  "$LIFECYCLE_DB", "./lifecycle.db", "NO_COLOR", "--version"):  # fmt: skip
        assert words in text, words
    for command in ("runs", "show", "diagnose", "verify", "trace", "diff"):
        assert command in text


def test_help_lists_every_exit_status_replay_returns(capsys: pytest.CaptureFixture[str]) -> None:
    """The epilog of `replay --help` lists 0, 1, 2 and 3: every status a command returns."""
    assert exit_statuses(help_of(capsys)) == set(ReplayExit) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("command", "statuses"),
    [
        ("runs", {0, 2}),
        ("show", {0, 2}),
        ("diagnose", {0, 1, 2, 3}),
        ("verify", {0, 1, 2}),
        ("trace", {0, 2}),
        ("diff", {0, 2}),
    ],
)
def test_each_command_help_explains_its_arguments_and_statuses(
    capsys: pytest.CaptureFixture[str], command: str, statuses: set[int]
) -> None:
    """`replay COMMAND --help` says what JOURNAL is (and RUN, where the command takes one) and
    lists the exit statuses that command returns."""
    text = help_of(capsys, command)
    assert "JOURNAL  a SQLite file path or a SQLAlchemy URL" in text
    assert "$LIFECYCLE_DB, else ./lifecycle.db" in text
    assert ("RUN      a run id, a unique prefix of one, or 'latest'" in text) == (
        command in COMMANDS_WITH_RUN
    )
    assert exit_statuses(text) == statuses


def failed_journal(path: Path, run_id: str) -> Path:
    """A one-rank run that fails in gate-check (diagnose exits 1)."""
    b = JournalBuilder(path, run_id=run_id, world_size=1)
    b.rank(0).walk(0.1, "gate-check")
    b.rank(0).add(0.5, Error(error_type="OutOfMemoryError", error_kind="exception",
                             message="CUDA out of memory", traceback="", trigger=None,
                             fatal=True))  # fmt: skip
    b.rank(0).walk(0.6, "failed")
    b.close()
    return path


@pytest.fixture
def in_empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LIFECYCLE_DB", raising=False)
    return tmp_path


DEFAULTED = [
    ["runs", *AS_WRITTEN],
    ["show", "latest"],
    ["diagnose", "latest", *AS_WRITTEN],
    ["verify", "latest"],
    ["verify", "--all"],
    ["trace", "latest", "-o", "-"],
    ["diff", "latest", "latest", *AS_WRITTEN],
]


def test_without_a_journal_every_command_reads_lifecycle_db(
    in_empty_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No JOURNAL: ./lifecycle.db is read, as `lifecycle boot` writes it by default."""
    failed_journal(in_empty_dir / "lifecycle.db", "run-default")
    assert main(["diagnose", "latest", *AS_WRITTEN]) == 1
    assert "run run-default: failed" in capsys.readouterr().out
    for argv in DEFAULTED:
        status = main(argv)
        out, err = capsys.readouterr()
        assert status in (0, 1), (argv, err)
        assert "run-default" in out, argv


def test_lifecycle_db_names_the_default_journal(
    in_empty_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$LIFECYCLE_DB, when set, is the journal read when none is named."""
    failed_journal(in_empty_dir / "lifecycle.db", "run-default")
    failed_journal(in_empty_dir / "elsewhere.db", "run-elsewhere")
    monkeypatch.setenv("LIFECYCLE_DB", str(in_empty_dir / "elsewhere.db"))
    assert main(["runs", *AS_WRITTEN]) == 0
    out = capsys.readouterr().out
    assert "run-elsewhere" in out and "run-default" not in out


@pytest.mark.parametrize("argv", DEFAULTED)
def test_a_missing_default_journal_is_one_line_and_never_created(
    in_empty_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """No JOURNAL and no ./lifecycle.db: one error line, exit 2, and nothing created."""
    assert main(argv) == ReplayExit.BAD_INPUT
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "replay: error: no JOURNAL given, and ./lifecycle.db does not exist: name a JOURNAL"
    ]
    assert list(in_empty_dir.iterdir()) == []


def test_a_missing_lifecycle_db_journal_is_named(
    in_empty_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """$LIFECYCLE_DB naming no file: the error names the variable and the path; exit 2."""
    missing = in_empty_dir / "nowhere" / "j.db"
    monkeypatch.setenv("LIFECYCLE_DB", str(missing))
    assert main(["diagnose", "latest"]) == ReplayExit.BAD_INPUT
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"replay: error: no JOURNAL given, and $LIFECYCLE_DB ({missing}) does not exist:"
        " name a JOURNAL"
    ]
    assert not missing.parent.exists()


def test_journals_after_an_option_are_still_journals(
    in_empty_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`show latest --rank 0 J` and `verify latest --json J` read J, not the default."""
    failed_journal(in_empty_dir / "j.db", "run-named")
    assert main(["show", "latest", "--rank", "0", "j.db"]) == ReplayExit.OK
    assert "run run-named" in capsys.readouterr().out
    assert main(["verify", "latest", "--json", "j.db"]) in (ReplayExit.OK, ReplayExit.FAILURE)
    assert "run-named" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stopped:
        main(["show", "latest", "--bogus"])
    assert stopped.value.code == ReplayExit.BAD_INPUT


def test_replay_completes_journals_and_dump_folders_in_bash(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`replay completion bash` prints a script under which a JOURNAL completes to the files
    here and `--flight-recorder` to folders only."""
    assert main(["completion", "bash"]) == ReplayExit.OK
    script = capsys.readouterr().out
    (tmp_path / "dumps").mkdir()
    (tmp_path / "node0.db").touch()
    assert bash_completions(script, ["replay", "runs", ""], cwd=tmp_path) == [
        "dumps", "node0.db"
    ]  # fmt: skip
    offered = bash_completions(script, ["replay", "show", "--flight-recorder", ""], cwd=tmp_path)
    assert offered == ["dumps"]


def test_replay_zsh_completion_is_a_compdef_script(capsys: pytest.CaptureFixture[str]) -> None:
    """`replay completion zsh` prints a #compdef script naming every command; a shell it
    does not know is a usage error, exit 2."""
    assert main(["completion", "zsh"]) == ReplayExit.OK
    script = capsys.readouterr().out
    assert script.startswith("#compdef replay")
    for command in ("runs", "show", "diagnose", "verify", "trace", "diff", "history"):
        assert command in script
    with pytest.raises(SystemExit) as stopped:
        main(["completion", "fish"])
    assert stopped.value.code == ReplayExit.BAD_INPUT
