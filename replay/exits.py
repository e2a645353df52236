"""What `replay` promises outside it: one table of exit statuses for every command, and the
errors that end a command with one line and exit 2."""

from __future__ import annotations

from enum import IntEnum

from lifecycle.core.command import OneLineParser
from lifecycle.core.errors import LifecycleError


class ReplayExit(IntEnum):
    """The exit statuses of every `replay` command."""

    OK = 0  # answered; diagnose: the run got to ready; verify: consistent with today's code
    FAILURE = 1  # diagnose: failed, hung or crashed; verify: inconsistent with today's code
    BAD_INPUT = 2  # a flag, a journal or a dump that cannot be used: one line on stderr
    NOT_READY = 3  # diagnose: no failure found and not ready (running, stopped, incomplete)


class Parser(OneLineParser):
    usage_status = ReplayExit.BAD_INPUT


class ReplayError(LifecycleError):
    """`replay` cannot answer: no usable journal, or a run reference that names no run."""


class Usage(ReplayError):
    """A command given what it cannot use: one line, exit 2."""


class RunNotFound(ReplayError):
    def __init__(self, *, ref: str, known: int) -> None:
        super().__init__(f"no run matches {ref!r} among {known} run(s)")
        self.ref = ref


class AmbiguousRun(ReplayError):
    def __init__(self, *, ref: str, candidates: list[str]) -> None:
        shown = ", ".join(candidates[:5]) + (" ..." if len(candidates) > 5 else "")
        super().__init__(f"run prefix {ref!r} matches {len(candidates)} runs: {shown}")
        self.ref = ref
        self.candidates = candidates
