"""The `replay` command line: its commands, options and help (argparse, no I/O)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lifecycle import __version__
from lifecycle.core.command import SHELLS
from replay.exits import Parser
from replay.helptext import (
    BAD_INPUT_EXIT,
    DIAGNOSE_HELP,
    HISTORY_HELP,
    HISTORY_NOTE,
    JOURNAL_HELP,
    RUN_HELP,
    epilog,
)

DEFAULT_LAST_COLLECTIVES = 10


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="replay",
        description="Read lifecycle journals after the fact and say what happened.",
        epilog=epilog("replay") + "\n\nColour only on a terminal, never with NO_COLOR set.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"replay (lifecycle {__version__})")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=Parser, title="commands", metavar="COMMAND"
    )
    # Added in the order that `replay --help` lists them.
    _judged_now(
        _command(
            commands, "runs", "one row per run: start, host, ranks, mode, path, outcome", run=False
        )
    )
    _add_show(commands)
    diagnose = _command(commands, "diagnose", DIAGNOSE_HELP)
    _judged_now(diagnose)
    _flight_recorder(diagnose)
    _add_verify(commands)
    _add_trace(commands)
    _add_diff(commands)
    history = _command(commands, "history", HISTORY_HELP, run=False)
    history.epilog = f"{HISTORY_NOTE}\n\n{history.epilog}"
    _add_completion(commands)
    return parser


def _subparser(
    commands: argparse._SubParsersAction[Parser], name: str, text: str, *, run: bool = True
) -> argparse.ArgumentParser:
    """A command with its help, and the epilog that lists its exits."""
    return commands.add_parser(
        name,
        help=text,
        description=text,
        epilog=epilog(name, run=run),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _command(
    commands: argparse._SubParsersAction[Parser], name: str, text: str, *, run: bool = True
) -> argparse.ArgumentParser:
    """A command that reads journals: its RUN (unless `run` is false), JOURNALs and --json."""
    p = _subparser(commands, name, text, run=run)
    if run:
        p.add_argument("run", metavar="RUN", help=RUN_HELP)
    p.add_argument("journals", metavar="JOURNAL", nargs="*", default=(), help=JOURNAL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def _judged_now(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--now",
        type=float,
        metavar="EPOCH",
        help="judge liveness (running, hung, crashed) as of this time, in seconds since the"
        " epoch (default: the current time)",
    )


def _flight_recorder(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--flight-recorder",
        metavar="DIR",
        help="PyTorch Flight Recorder dumps (pickled or JSON, a file per rank, named with"
        " its rank at the end) to join with the run (default: the dumps its ranks journaled"
        " writing, where they are here)",
    )


def _add_show(commands: argparse._SubParsersAction[Parser]) -> None:
    show = _command(
        commands,
        "show",
        "each rank's timeline: states, warmup records, buffers, errors, and its last"
        " collectives before the end",
    )
    show.add_argument("--rank", type=int, action="append", help="only this rank (repeatable)")
    show.add_argument(
        "--last",
        type=count_of,
        default=DEFAULT_LAST_COLLECTIVES,
        metavar="N",
        help="collective records shown per rank before its end"
        f" (default: {DEFAULT_LAST_COLLECTIVES})",
    )
    show.add_argument(
        "--all", action="store_true", help="every event of each rank, in order, as it is read"
    )
    show.add_argument(
        "--at", type=float, metavar="SECONDS", help="every rank's state this long after the start"
    )
    _flight_recorder(show)


def _add_verify(commands: argparse._SubParsersAction[Parser]) -> None:
    verify = _subparser(
        commands,
        "verify",
        "replay a run (or every run) against today's gates, plan and transition table",
    )
    # RUN and the JOURNALs share one positional: argparse's own usage line cannot say that
    # --all takes the place of RUN.
    verify.usage = "replay verify [-h] [--json] (RUN | --all) [JOURNAL ...]"
    verify.add_argument("--all", action="store_true", help="check every run (then no RUN)")
    verify.add_argument(
        "targets",
        metavar="RUN JOURNAL",
        nargs="*",
        default=(),
        help=f"RUN, {RUN_HELP}; then JOURNAL, {JOURNAL_HELP}",
    )
    verify.add_argument("--json", action="store_true", help="print JSON")


def _add_trace(commands: argparse._SubParsersAction[Parser]) -> None:
    trace = _command(commands, "trace", "Chrome Trace Event JSON for chrome://tracing and Perfetto")
    _flight_recorder(trace)
    trace.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="a new file or a regular file to replace (never a journal being read); - for stdout",
    )


def _add_diff(commands: argparse._SubParsersAction[Parser]) -> None:
    diff = _subparser(commands, "diff", "two runs side by side, with a verdict")
    diff.add_argument("run_a", metavar="RUN_A", help=RUN_HELP)
    diff.add_argument("run_b", metavar="RUN_B", help=RUN_HELP)
    diff.add_argument("journals", metavar="JOURNAL", nargs="*", default=(), help=JOURNAL_HELP)
    diff.add_argument("--json", action="store_true", help="print JSON")
    _judged_now(diff)


def _add_completion(commands: argparse._SubParsersAction[Parser]) -> None:
    completion = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script for the whole replay command, e.g.\n"
        '  eval "$(replay completion bash)"    (in ~/.bashrc)\n'
        "  replay completion zsh > ~/.zfunc/_replay    (a directory in $fpath)",
        epilog="exit status:\n  0  printed\n" + BAD_INPUT_EXIT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    completion.add_argument("shell", choices=SHELLS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, JOURNALs after an option included: argparse (3.11 at least) matches
    an empty `nargs="*"` before the first option and leaves the JOURNALs after it unclaimed."""
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and not any(arg.startswith("-") for arg in extra):
        field = "targets" if ns.command == "verify" else "journals"
        setattr(ns, field, [*getattr(ns, field), *extra])
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return ns


def count_of(text: str) -> int:
    """A non-negative whole number of records."""
    if not text.isascii() or not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of records")
    return int(text)
