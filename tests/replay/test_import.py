"""replay never imports torch, and starts at once."""

from __future__ import annotations

import subprocess
import sys

from tests.replay.conftest import Journaled
from tests.support.interpreter import run_python


def test_importing_the_cli_leaves_torch_unimported() -> None:
    """`import replay.cli` and every command module it loads keep torch out of sys.modules."""
    modules = (
        "replay.cli", "replay.load", "replay.verify", "replay.diff", "replay.output",
        "replay.verdict.analysis", "replay.verdict.diagnose", "replay.verdict.summary",
        "replay.verdict.status", "replay.verdict.liveness", "lifecycle.verdict.analysis",
        "lifecycle.verdict.diagnose", "lifecycle.verdict.status", "lifecycle.verdict.culprits",
        "lifecycle.verdict.evidence", "lifecycle.verdict.endings", "lifecycle.verdict.headline",
        "lifecycle.verdict.launched", "replay.views.trace", "replay.views.render",
        "replay.views.runs", "replay.views.diagnosis", "replay.views.timeline",
    )  # fmt: skip
    code = f"import sys, {', '.join(modules)}; sys.exit(1 if 'torch' in sys.modules else 0)"
    done = run_python(code)
    assert done.returncode == 0, done.stderr


def test_running_every_command_leaves_torch_unimported(
    bounded_and_calibrated: Journaled, tmp_path: object
) -> None:
    """Diagnosing, verifying and tracing a real journal never imports torch."""
    db = str(bounded_and_calibrated.db)
    code = (
        "import sys, contextlib, io\n"
        "from replay.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    for argv in (['runs', {db!r}], ['show', 'latest', {db!r}],"
        f" ['diagnose', 'latest', {db!r}], ['verify', '--all', {db!r}]):\n"
        "        main(argv)\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr


def test_help_works_without_any_journal() -> None:
    """`replay --help` lists the commands and exits 0."""
    result = subprocess.run(
        [sys.executable, "-m", "replay", "--help"], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0
    for command in ("runs", "show", "diagnose", "verify", "trace", "diff"):
        assert command in result.stdout
