"""What the `lifecycle` command promises outside it: one table of exit statuses for boot,
serve, db, first-run and the rank processes they start, the journal it writes when none is
named, and the one-line report of a bad flag (see the README's Architecture section)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from enum import IntEnum
from typing import ClassVar, NoReturn


class Exit(IntEnum):
    """The exit statuses of `lifecycle` and of each rank process; 128+N is signal N."""

    OK = 0  # boot: every rank got to ready; serve: stopped cleanly; db, first-run: done
    FAILED = 1  # a rank failed, hung or died; or was not ready within --startup-timeout
    USAGE = 2  # bad input: a flag, a config file, a journal that is not this lifecycle's
    UNJOURNALED = 3  # the journal could not be written: the record is incomplete from there


SIGNAL_EXIT_BASE = 128  # a process ended by signal N exits 128+N, as a shell reports it

JOURNAL_ENV = "LIFECYCLE_DB"
DEFAULT_JOURNAL = "lifecycle.db"
DEFAULT_JOURNAL_HELP = f"default: ${JOURNAL_ENV}, else {DEFAULT_JOURNAL}"


def default_journal(env: Mapping[str, str]) -> str:
    """The journal where no flag or config file names one: $LIFECYCLE_DB if set and not
    empty, else ./lifecycle.db."""
    return env.get(JOURNAL_ENV) or DEFAULT_JOURNAL


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with the
    command's usage status."""

    usage_status: ClassVar[int] = Exit.USAGE

    def error(self, message: str) -> NoReturn:
        self.exit(self.usage_status, f"{self.prog}: error: {message}\n")
