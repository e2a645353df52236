"""A command line run in the test's own process: the console script's entry function called
with its arguments in a working directory, its exit status (SystemExit's included) and what it
wrote. For the many bad-input cases that refuse before anything starts, where a process of
their own would spend its second importing the lifecycle; each refusal is also checked as a
real process by at least one test beside it."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.conftest import Completed


def run_in_process(
    entry: Callable[[Sequence[str]], int],
    argv: Sequence[str],
    *,
    cwd: Path,
    capsys: pytest.CaptureFixture[str],
) -> Completed:
    """`entry(argv)` in `cwd`. An exception other than SystemExit is not caught: it fails the
    test, as a traceback would fail a real process's check."""
    capsys.readouterr()  # what the test wrote before is not the command's
    before = Path.cwd()
    os.chdir(cwd)
    try:
        try:
            code = entry(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        os.chdir(before)
    said = capsys.readouterr()
    return Completed(code, said.out, said.err)
