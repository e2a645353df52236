"""Journal locations: a URL's password is never stored in a journal nor shown in a message."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.settings.config import ServerArgs
from lifecycle.store import Journal, RunRow, shown_location
from lifecycle.store.location import command_without_passwords, without_password
from lifecycle.store.runs import launch_command, run_row

SECRET = "s3cr3t-Pa55"
URL = f"postgresql+psycopg://lifecycle:{SECRET}@db.example:5432/journals"
HIDDEN_URL = "postgresql+psycopg://lifecycle:***@db.example:5432/journals"


def journal_bytes(path: Path) -> bytes:
    """Every byte of a journal, its -wal and -shm files included where they are left."""
    files = [path, *(path.with_name(path.name + suffix) for suffix in ("-wal", "-shm"))]
    return b"".join(f.read_bytes() for f in files if f.exists())


def test_a_url_password_is_in_no_row_of_the_journal(tmp_path: Path) -> None:
    """A run launched with `--db URL` records the URL with its password hidden, in the
    config's db and in the command line: the secret is nowhere in the journal's file."""
    command = launch_command(["lifecycle", "boot", "--model", "micro-video", "--db", URL])
    row = run_row(ServerArgs(db=URL), run_id="run-1", created_at=time.time(), command=command)
    path = tmp_path / "j.db"
    journal = Journal.open_for_write(str(path))
    journal.create_run(row)
    (stored,) = journal.runs()
    journal.close()
    assert stored.config["db"] == HIDDEN_URL
    assert stored.command == launch_command(
        ["lifecycle", "boot", "--model", "micro-video", "--db", HIDDEN_URL]
    )
    assert SECRET.encode() not in journal_bytes(path)


def test_a_password_stored_by_an_older_lifecycle_is_not_shown(tmp_path: Path) -> None:
    """A runs row written with a password in it (before passwords were hidden) is read
    back without it."""
    path = tmp_path / "j.db"
    journal = Journal.open_for_write(str(path))
    journal.create_run(
        RunRow(run_id="run-1", created_at=1.0, host="h", world_size=1, config={},
               lifecycle_version="0.1.0")
    )  # fmt: skip
    journal.close()
    with sqlite3.connect(path) as conn:
        conn.execute(
            "UPDATE runs SET config = json_object('db', ?), command = ?",
            (URL, f"lifecycle boot --db {URL}"),
        )
    reader = Journal.open_for_read(str(path))
    (run,) = reader.runs()
    reader.close()
    assert run.config == {"db": HIDDEN_URL}
    assert run.command == launch_command(["lifecycle", "boot", "--db", HIDDEN_URL])


@pytest.mark.parametrize(
    ("location", "shown"),
    [
        (URL, HIDDEN_URL),
        ("postgresql://u:pa@ss@h/db", "postgresql://u:***@h/db"),  # an unquoted @ in it
        ("postgresql://u:secret@h:port/db", "postgresql://u:***@h:port/db"),  # not parseable
        ("postgresql://h/db?sslmode=require&password=secret", "postgresql://h/db?sslmode=require&password=***"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("my:pass@word.db", "my:pass@word.db"),  # a file name, not a URL
    ],
)  # fmt: skip
def test_a_location_is_shown_without_its_password(location: str, shown: str) -> None:
    """Messages show a URL with its password as `***`, however the URL is spelled; a file
    path is shown as it is."""
    assert shown_location(location) == shown
    assert without_password(location) == shown


def test_a_command_without_urls_is_kept_byte_for_byte() -> None:
    """A command line with no URL password in it is recorded exactly as given."""
    command = "lifecycle  boot --db 'my journal.db' --fault 0:gate-check:raise"
    assert command_without_passwords(command) == command


@given(password=st.text(alphabet=st.characters(blacklist_characters="@\x00"), max_size=20))
def test_no_password_survives_in_a_command_line(password: str) -> None:
    """Whatever characters a password holds, and however the URL is passed, the command line
    keeps none of it."""
    marked = f"SECRET{password}"
    url = f"postgresql://user:{marked}@host/db"
    for argv in (["lifecycle", "boot", "--db", url], ["lifecycle", "boot", f"--db={url}"]):
        hidden = command_without_passwords(launch_command(argv))
        assert "SECRET" not in hidden
        assert "postgresql://user:***@host/db" in hidden
