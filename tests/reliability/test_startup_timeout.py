"""A startup that hangs outside any collective is ended by `--startup-timeout`."""

from __future__ import annotations

from pathlib import Path

import pytest

from lifecycle.core.format.events import Error, Transition
from lifecycle.store.journal import Journal
from tests.conftest import run_cli

pytestmark = [pytest.mark.usefixtures("no_leftover_processes")]


def test_a_hung_one_rank_startup_fails_at_the_startup_timeout(tmp_path: Path) -> None:
    """A rank hung in gate-check (nothing else would end it) journals a StartupTimeout error
    naming the state, goes to failed, and `lifecycle boot` exits 1."""
    result = run_cli(
        "lifecycle",
        ["boot", "--model", "micro-video", "--db", "j.db", "--log-level", "error",
         "--heartbeat-interval", "0.2", "--fault", "0:gate-check:hang", "--startup-timeout", "2"],
        cwd=tmp_path,
        timeout=90,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "StartupTimeout" in result.stdout
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    (run,) = journal.runs()
    events = list(journal.read(run_id=run.run_id))
    errors = [e.event for e in events if isinstance(e.event, Error)]
    assert [(e.error_type, e.fatal) for e in errors] == [("StartupTimeout", True)]
    assert errors[0].message == (
        "startup did not reach ready within 2 s (--startup-timeout); still in gate-check"
    )
    assert "threading.Event().wait()" in errors[0].traceback  # where the main thread was stuck
    transitions = [e.event.dest for e in events if isinstance(e.event, Transition)]
    assert transitions == ["gate-check", "failed"]
