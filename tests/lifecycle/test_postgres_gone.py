"""PostgreSQL going away under a booting group of ranks is a journal that could not be written
(exit 3), not bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lifecycle.core.errors import JournalError
from lifecycle.store.journal import Journal
from tests.conftest import reaped, wait_until
from tests.pg import PASSWORD, postgres_server
from tests.support.interpreter import run_python

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


def reached(url: str, state: str) -> bool:
    """Whether a rank of the journal's run has journaled `state`."""
    try:
        with Journal.open_for_read(url) as journal:
            return state in {stored.state for stored in journal.read()}
    except JournalError:
        return False


def test_a_server_stopped_under_booting_ranks_is_exit_3_in_lines_naming_the_journal(
    tmp_path: Path,
) -> None:
    """The server is stopped while two ranks are in bounded-warm: the boot exits 3, and what it
    says on stderr is `lifecycle: error:` lines, no traceback, each saying the journal (its
    password hidden) could not be written."""
    with postgres_server() as server:  # a server of its own: this test stops it
        url = server.create_database("stopped_mid_boot")
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video", "--num-ranks",
             "2", "--db", url, "--log-level", "error"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with reaped(proc):
            wait_until(lambda: reached(url, "bounded-warm"), within=120, what="bounded-warm")
            server.stop()
            out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines, out
    for line in lines:
        assert line.startswith("lifecycle: error: "), err
        assert "journal postgresql://lifecycle:***@127.0.0.1:" in line, err
        assert "could not be written" in line, err
    assert PASSWORD not in out + err


def test_the_drivers_own_notes_on_a_lost_connection_are_not_printed() -> None:
    """What psycopg and SQLAlchemy's pool log when a connection is lost (the pool's `Error
    closing cursor` carries the driver's traceback) is not written to stderr beside the
    store's own line: with no handler of their own, Python's last-resort handler would."""
    code = (
        "import lifecycle.store.backends.postgres, logging\n"
        "try:\n"
        "    raise OSError('server closed the connection unexpectedly')\n"
        "except OSError:\n"
        "    logging.getLogger('sqlalchemy.pool.impl.QueuePool').error("
        "'Error closing cursor', exc_info=True)\n"
        "    logging.getLogger('psycopg').warning('error ignored terminating pipeline')\n"
    )
    done = run_python(code, check=True)
    assert done.stderr == ""
