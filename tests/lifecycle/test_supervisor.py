"""The launcher's summary of several ranks: exit statuses in words, and the boot's verdict."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lifecycle.serve.supervisor import exit_text
from tests.conftest import Completed


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        (None, "running"),
        (0, "exit 0"),
        (1, "exit 1"),
        (3, "exit 3"),
        (-9, "killed by SIGKILL"),
        (-6, "killed by SIGABRT"),
        (143, "stopped by SIGTERM (143)"),
        (130, "stopped by SIGINT (130)"),
        (255, "exit 255"),
    ],
)
def test_an_exit_status_reads_one_way(code: int | None, shown: str) -> None:
    """A rank's exit status reads as `exit N`, `killed by SIGNAL` (a signal it did not handle)
    or `stopped by SIGNAL (128+N)` (a stop it journaled), wherever it is shown."""
    assert exit_text(code) == shown


@pytest.mark.ranks
def test_a_rank_failing_at_ready_fails_the_boot_and_its_summary_says_so(
    lifecycle_cli: Callable[..., Completed],
) -> None:
    """With rank 1 failing on entering ready while rank 0 gets there, `boot` exits 1, prints
    no "startup to ready" line, shows each rank's exit status in words, and ends on a line
    that gives the exit status and the failure."""
    result = lifecycle_cli(
        "boot", "--db", "j.db", "--model", "micro-video", "--warmup-mode", "none",
        "--num-ranks", "2", "--dist-timeout", "3", "--fault", "1:ready:raise",
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "startup to ready" not in result.stdout, result.stdout
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "boot: exit 1: rank 1 failed in ready", lines[-3:]
    assert lines[-3].startswith("rank 0: stopped") and lines[-3].endswith("; exit 0"), lines
    assert lines[-2].startswith("rank 1: failed"), lines
    # The failed rank exits on its own (it lingers only under --on-peer-failure wait).
    assert "; exit 1; InjectedFault: " in lines[-2], lines
