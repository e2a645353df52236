"""`lifecycle db`: the journal's schema revision, its upgrade, retention and copies."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from lifecycle.core.command import DEFAULT_JOURNAL_HELP, Exit, default_journal
from lifecycle.core.errors import ConfigError, LifecycleError
from lifecycle.serve.logs import say


def add_db_command(sub: Any) -> None:
    """The `db` command and its subcommands, under the top-level parser's `sub`."""
    db = sub.add_parser(
        "db", help="journal schema, retention and copies: current, upgrade, prune, copy"
    )
    db_sub = db.add_subparsers(dest="db_command", required=True, parser_class=sub._parser_class)
    for name, text in (
        ("current", "print the journal's schema revision"),
        ("upgrade", "migrate this lifecycle's own journal to the newest schema"),
        ("prune", "remove old runs, whole, from the journal"),
        ("copy", "copy a journal's runs into another (a node's file into the fleet's database)"),
    ):
        cmd = db_sub.add_parser(name, help=text)
        cmd.add_argument(
            "--db",
            default=default_journal(os.environ),
            help=f"journal path or SQLAlchemy URL ({DEFAULT_JOURNAL_HELP})",
        )
        if name == "prune":
            _add_prune_options(cmd)
        if name == "copy":
            cmd.add_argument(
                "--to", required=True, metavar="JOURNAL", help="the journal to copy into"
            )
            cmd.add_argument(
                "--run", action="append", metavar="RUN_ID", help="only this run (repeatable)"
            )


PRUNE_DESCRIPTION = """\
Remove old runs from the journal, each with its rows in every table, a few at a time so that
servers appending to the same journal are not held up. With both --keep-runs and
--older-than, only runs that both select are removed. The newest run, and any run written to
in the last 10 minutes, are never removed. A removed run's Flight Recorder dumps go with it:
only those its ranks wrote on this host into the run's own dump folder while journaling into
this journal (never the files that rows copied from another journal name). A SQLite file does
not shrink: the freed pages are reused by later appends (VACUUM would rewrite the whole file
while blocking every writer).
"""


def _add_prune_options(prune: argparse.ArgumentParser) -> None:
    def keep_count(text: str) -> int:
        if not text.isascii() or not text.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of runs (0 or more)")
        return int(text)

    def duration(text: str) -> float:
        from lifecycle.store.upkeep.prune import parse_duration

        try:
            return parse_duration(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    prune.description = PRUNE_DESCRIPTION
    prune.formatter_class = argparse.RawDescriptionHelpFormatter
    prune.add_argument("--keep-runs", type=keep_count, metavar="N", help="keep the N newest runs")
    prune.add_argument(
        "--older-than",
        type=duration,
        metavar="DURATION",
        help="remove runs created longer ago than this: 45s, 90m, 12h, 30d, 2w",
    )
    prune.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would go (each Flight Recorder dump file by path); change nothing",
    )
    prune.add_argument("--now", type=float, help=argparse.SUPPRESS)  # tests: a fixed clock


def run_db_command(ns: argparse.Namespace) -> int:
    from lifecycle.store import Journal, head_revision, journal_revision

    try:
        if ns.db_command == "current":
            print(f"{journal_revision(ns.db)} (head {head_revision()})")
            return 0
        if ns.db_command == "prune":
            return _prune(ns)
        if ns.db_command == "copy":
            return _copy(ns)
        with Journal.open_for_write(ns.db, upgrade=True) as journal:
            filled = journal.backfill_summaries()
        shown = journal.location
        print(
            f"{shown}: at {head_revision()}" + (f"; summarized {filled} rank(s)" if filled else "")
        )
        return 0
    except LifecycleError as exc:
        return fail(exc)


def _copy(ns: argparse.Namespace) -> int:
    from lifecycle.store import Journal
    from lifecycle.store.location import same_journal, shown_location
    from lifecycle.store.upkeep.copy import CopyStopped, copy_journal, runs_to_copy

    if same_journal(ns.db, ns.to):
        # Checked before either is opened: opening the source may remove a file at its
        # sidecar's name, and a copy into the source would write what it reads.
        raise ConfigError(
            f"--to {shown_location(ns.to)} is the journal being copied"
            f" ({shown_location(ns.db)}) or one of its files; copy into another journal"
        )
    with Journal.open_for_read(ns.db) as source:
        # The runs named are checked before the destination is opened, which creates it.
        runs_to_copy(source, ns.run)
        with Journal.open_for_write(ns.to) as into:
            try:
                copied = copy_journal(source, into, run_ids=ns.run)
            except CopyStopped as exc:
                sys.stdout.flush()
                print(f"lifecycle: error: {exc}", file=sys.stderr)
                return Exit.UNJOURNALED if exc.unjournaled else Exit.USAGE
        line = copied.line(source.location, into.location)
        if copied.left_out:
            # What was copied stays copied; the rows left out are the source's fault.
            print(f"lifecycle: error: {line}", file=sys.stderr)
            return Exit.USAGE
        print(line)
    return 0


def _prune(ns: argparse.Namespace) -> int:
    from lifecycle.store.upkeep.prune import (
        RetentionPolicy,
        format_outcome,
        open_for_pruning,
        prune,
    )

    policy = RetentionPolicy(keep_runs=ns.keep_runs, older_than_s=ns.older_than)
    with open_for_pruning(ns.db) as journal:
        now = time.time() if ns.now is None else ns.now
        outcome = prune(journal, policy, now=now, dry_run=ns.dry_run)
        print(format_outcome(outcome, journal.location))
        if outcome.dry_run:
            for path in outcome.dump_files:
                print(f"  {path}")
    return 0


def fail(exc: LifecycleError, *, shown: str | None = None) -> int:
    """One line for an error that reached the command's top (`shown`: its message as the
    command words it), and the status it carries."""
    sys.stdout.flush()
    text = str(exc) if shown is None else shown
    say(f"lifecycle: error: {text}", event="error", out=sys.stderr, exit_status=exc.exit_status)
    return int(exc.exit_status)
