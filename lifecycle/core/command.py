"""What the `lifecycle` command promises outside it: one table of exit statuses for boot,
serve, db, first-run and the rank processes they start, the journal it writes when none is
named, and the one-line report of a bad flag (see docs/architecture.md)."""

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

# The project's name on PyPI (`lifecycle` there is another project): every install line and
# hint names it. The import packages are `lifecycle` and `replay`.
DISTRIBUTION = "diffusion-lifecycle"


def extra(name: str) -> str:
    """What `pip install` takes for one of the project's extras, e.g. diffusion-lifecycle[otel]."""
    return f"{DISTRIBUTION}[{name}]"


JOURNAL_ENV = "LIFECYCLE_DB"
DEFAULT_JOURNAL = "lifecycle.db"
DEFAULT_JOURNAL_HELP = f"default: ${JOURNAL_ENV}, else {DEFAULT_JOURNAL}"


def installed_torch() -> str | None:
    """torch's version as installed, read from its metadata so that asking never imports
    torch; None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return None


def default_journal(env: Mapping[str, str]) -> str:
    """The journal where no flag or config file names one: $LIFECYCLE_DB if set and not
    empty, else ./lifecycle.db."""
    return env.get(JOURNAL_ENV) or DEFAULT_JOURNAL


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits with the
    command's usage status. The line starts `lifecycle: error: ` (`replay: error: `) whichever
    subcommand refused it, as every other refusal of the command does, where argparse would
    say `lifecycle boot: error: `."""

    usage_status: ClassVar[int] = Exit.USAGE

    def error(self, message: str) -> NoReturn:
        command = self.prog.split(" ", 1)[0]
        self.exit(self.usage_status, f"{command}: error: {message}\n")


SHELLS = ("bash", "zsh", "tcsh")
CONFIG_SUFFIXES = ("toml", "yaml", "yml")
# A config file completes to the files of CONFIG_SUFFIXES (and folders, to descend into).
_CONFIG_FILES = {
    "bash": "_lifecycle_compgen_config_files",
    "zsh": "_files -g '*.(" + "|".join(CONFIG_SUFFIXES) + ")'",
    "tcsh": "f:*.{" + ",".join(CONFIG_SUFFIXES) + "}",
    "preamble": {
        "bash": '\n_lifecycle_compgen_config_files() {\n  compgen -d -- "$1"\n'
        + "".join(f"  compgen -f -X '!*.{suffix}' -- \"$1\"\n" for suffix in CONFIG_SUFFIXES)
        + "}\n"
    },
}


def completion_script(
    parser: argparse.ArgumentParser,
    shell: str,
    *,
    files: frozenset[str] = frozenset(),
    folders: frozenset[str] = frozenset(),
    configs: frozenset[str] = frozenset(),
) -> str:
    """The shell's completion script for `parser` (shtab), offering file names for the
    options and positionals named in `files` (by option string or dest), folder names for
    `folders`, and config files (.toml, .yaml, .yml) for `configs`."""
    import shtab

    for action in _all_actions(parser):
        names = {*action.option_strings, action.dest}
        if names & configs:
            action.complete = _CONFIG_FILES  # type: ignore[attr-defined]  # shtab reads it
        elif names & folders:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
        elif names & files:
            action.complete = shtab.FILE  # type: ignore[attr-defined]
    return str(shtab.complete(parser, shell=shell))


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    found = []
    for action in parser._actions:
        found.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_all_actions(sub))
    return found
