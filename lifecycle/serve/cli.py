"""The `lifecycle` command: boot, serve, diagram, db."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from lifecycle.core.config import (
    DEFAULT_RING_CAPACITY,
    DEFAULT_STARTUP_TIMEOUT_S,
    MODEL_PRESETS,
    PerformanceMode,
    ServerArgs,
    SmokeRequest,
    WarmupMode,
)
from lifecycle.core.errors import EXIT_UNJOURNALED, ConfigError, JournalWriteFailed, LifecycleError
from lifecycle.core.faults import parse_faults
from lifecycle.core.residency import parse_size
from lifecycle.serve.logs import LEVELS, configure_logging

EXIT_READY = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

EXIT_STATUS_EPILOG = f"""\
exit status:
  0    every rank got to ready
  1    a rank failed (or was not ready within --startup-timeout)
  2    bad input: a flag, a journal that is not this lifecycle's or may not be
       written, an environment (torchrun's) that cannot be used
  {EXIT_UNJOURNALED}    the journal could not be written (disk full, I/O error): the startup
       stopped there, and its record is incomplete
  128+N  ended by signal N (143 for SIGTERM)
"""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (no usage dump) and exits 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _add_startup_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-video", help="model preset (default: tiny-video)")
    p.add_argument(
        "--pipeline", metavar="MODULE:ATTR", help="import a (ModelSpec, factory) plug-in"
    )
    p.add_argument(
        "--db",
        default=os.environ.get("LIFECYCLE_DB", "lifecycle.db"),
        help="journal path or SQLAlchemy URL (default: $LIFECYCLE_DB or lifecycle.db)",
    )
    p.add_argument("--performance-mode", choices=[m.value for m in PerformanceMode], default="auto")
    p.add_argument("--warmup-mode", choices=[m.value for m in WarmupMode], default="server")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate even when a verified residency plan could be reused (and on a"
        " pipeline without residency options: measure only)",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="the residency planner's budget per rank, e.g. 600MiB or 2GiB (default: the"
        " device's free memory less max(1 GiB, total / 50) of headroom)",
    )
    p.add_argument("--num-ranks", type=int, default=1)
    p.add_argument("--cfg-parallel", type=int, default=1)
    p.add_argument("--ulysses", type=int, default=None, help="default: num-ranks / cfg-parallel")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="process-group timeout, as NCCL's watchdog (default: 600)",
    )
    p.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument(
        "--ring-size",
        type=int,
        default=DEFAULT_RING_CAPACITY,
        metavar="RECORDS",
        help="collective records each rank keeps after ready, written to the journal only on"
        f" trouble (default: {DEFAULT_RING_CAPACITY})",
    )
    p.add_argument(
        "--state-deadline",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a state that lasts longer is journaled as stalled, with every stack",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        metavar="SECONDS",
        help="a rank not ready this long after it started journals the error and fails"
        f" (default: {DEFAULT_STARTUP_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--smoke-request",
        choices=[m.value for m in SmokeRequest],
        default="auto",
        help="run one request at ready (auto: after drop-buffers)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="RANK:STATE:KIND",
        help="inject a fault (repeatable; also LIFECYCLE_FAULTS, comma-separated)",
    )
    p.add_argument("--json-logs", action="store_true", help="structlog JSON lines on stderr")
    p.add_argument("--log-level", choices=LEVELS, default="info")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="lifecycle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    boot = sub.add_parser(
        "boot",
        help="run a startup to ready and exit (0 ready, 1 failed)",
        epilog=EXIT_STATUS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_startup_options(boot)
    serve = sub.add_parser("serve", help="boot, then serve HTTP until SIGTERM")
    _add_startup_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    sub.add_parser("diagram", help="print the state machine as Mermaid")
    db = sub.add_parser(
        "db", help="journal schema, retention and copies: current, upgrade, prune, copy"
    )
    db_sub = db.add_subparsers(dest="db_command", required=True, parser_class=_Parser)
    for name, text in (
        ("current", "print the journal's schema revision"),
        ("upgrade", "migrate this lifecycle's own journal to the newest schema"),
        ("prune", "remove old runs, whole, from the journal"),
        ("copy", "copy a journal's runs into another (a node's file into the fleet's database)"),
    ):
        cmd = db_sub.add_parser(name, help=text)
        cmd.add_argument("--db", default=os.environ.get("LIFECYCLE_DB", "lifecycle.db"))
        if name == "prune":
            _add_prune_options(cmd)
        if name == "copy":
            cmd.add_argument(
                "--to", required=True, metavar="JOURNAL", help="the journal to copy into"
            )
            cmd.add_argument(
                "--run", action="append", metavar="RUN_ID", help="only this run (repeatable)"
            )
    return parser


PRUNE_DESCRIPTION = """\
Remove old runs from the journal, each with its rows in every table, a few at a time so that
servers appending to the same journal are not held up. With both --keep-runs and
--older-than, only runs that both select are removed. The newest run, and any run written to
in the last 10 minutes, are never removed. A SQLite file does not shrink: the freed pages are
reused by later appends (VACUUM would rewrite the whole file while blocking every writer).
"""


def _add_prune_options(prune: argparse.ArgumentParser) -> None:
    def keep_count(text: str) -> int:
        if not text.isascii() or not text.isdigit():
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of runs (0 or more)")
        return int(text)

    def duration(text: str) -> float:
        from lifecycle.store.prune import parse_duration

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
    prune.add_argument("--dry-run", action="store_true", help="say what would go; change nothing")
    prune.add_argument("--now", type=float, help=argparse.SUPPRESS)  # tests: a fixed clock


def server_args(ns: argparse.Namespace) -> ServerArgs:
    """ServerArgs from parsed options and the environment; ConfigError on anything invalid."""
    if ns.pipeline:
        from lifecycle.runtime.pipeline import load_plugin

        load_plugin(ns.pipeline)
    model = MODEL_PRESETS.get(ns.model)
    if model is None:
        raise ConfigError(
            f"--model {ns.model!r} is not one of {', '.join(sorted(MODEL_PRESETS))}", field="model"
        )
    ulysses = (
        ns.ulysses if ns.ulysses is not None else max(1, ns.num_ranks // max(1, ns.cfg_parallel))
    )
    return ServerArgs(
        model=model,
        db=ns.db,
        performance_mode=PerformanceMode(ns.performance_mode),
        warmup_mode=WarmupMode(ns.warmup_mode),
        calibrate=ns.calibrate,
        disable_auto_residency=_truthy(os.environ.get("LIFECYCLE_DISABLE_AUTO_RESIDENCY")),
        num_ranks=ns.num_ranks,
        cfg_parallel=ns.cfg_parallel,
        ulysses=ulysses,
        device=ns.device,
        dist_timeout_s=ns.dist_timeout,
        heartbeat_interval_s=ns.heartbeat_interval,
        state_deadline_s=ns.state_deadline,
        startup_timeout_s=ns.startup_timeout,
        ring_capacity=ns.ring_size,
        smoke_request=SmokeRequest(ns.smoke_request),
        memory_budget_bytes=None if ns.memory_budget is None else parse_size(ns.memory_budget),
        faults=parse_faults(ns.fault, os.environ.get("LIFECYCLE_FAULTS")),
        seed=ns.seed,
    )


def _fail_usage(message: str) -> int:
    print(f"lifecycle: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _fail_unjournaled(exc: JournalWriteFailed) -> int:
    sys.stdout.flush()
    print(f"lifecycle: error: {exc}", file=sys.stderr)
    return EXIT_UNJOURNALED


def main(argv: Sequence[str] | None = None) -> int:
    created_at = time.time()
    ns = build_parser().parse_args(argv)
    if ns.command == "diagram":
        from lifecycle.core.states import mermaid

        sys.stdout.write(mermaid())
        return 0
    if ns.command == "db":
        return _db(ns)
    try:
        args = server_args(ns)
    except ConfigError as exc:
        return _fail_usage(str(exc))
    configure_logging(json=ns.json_logs, level=ns.log_level)
    from lifecycle.serve.worker import under_torchrun

    if ns.command == "boot" and (args.num_ranks == 1 or under_torchrun(os.environ)):
        # This process is a rank: block the shutdown signals before torch starts threads.
        from lifecycle.runtime.signals import block_shutdown_signals

        block_shutdown_signals()
    from lifecycle.serve.launch import boot, serve
    from lifecycle.serve.supervisor import LaunchOptions
    from lifecycle.store.runs import launch_command

    options = LaunchOptions(
        pipeline=ns.pipeline,
        json_logs=ns.json_logs,
        log_level=ns.log_level,
        command=launch_command(["lifecycle", *(sys.argv[1:] if argv is None else argv)]),
    )
    try:
        if ns.command == "serve":
            return serve(args, created_at=created_at, options=options, host=ns.host, port=ns.port)
        return boot(args, created_at=created_at, options=options)
    except JournalWriteFailed as exc:
        return _fail_unjournaled(exc)
    except LifecycleError as exc:
        return _fail_usage(str(exc))


def _db(ns: argparse.Namespace) -> int:
    from lifecycle.store import Journal, head_revision, journal_revision

    try:
        if ns.db_command == "current":
            print(f"{journal_revision(ns.db)} (head {head_revision()})")
            return 0
        if ns.db_command == "prune":
            return _prune(ns)
        if ns.db_command == "copy":
            from lifecycle.store.copy import copy_journal

            with Journal.open_for_read(ns.db) as source, Journal.open_for_write(ns.to) as into:
                copied = copy_journal(
                    source, into, run_ids=set(ns.run) if ns.run is not None else None
                )
            print(copied.line(source.location, into.location))
            return 0
        with Journal.open_for_write(ns.db, upgrade=True) as journal:
            filled = journal.backfill_summaries()
        shown = journal.location
        print(
            f"{shown}: at {head_revision()}" + (f"; summarized {filled} rank(s)" if filled else "")
        )
        return 0
    except JournalWriteFailed as exc:
        return _fail_unjournaled(exc)
    except LifecycleError as exc:
        return _fail_usage(str(exc))


def _prune(ns: argparse.Namespace) -> int:
    from lifecycle.store.prune import RetentionPolicy, format_outcome, open_for_pruning, prune

    policy = RetentionPolicy(keep_runs=ns.keep_runs, older_than_s=ns.older_than)
    with open_for_pruning(ns.db) as journal:
        now = time.time() if ns.now is None else ns.now
        outcome = prune(journal, policy, now=now, dry_run=ns.dry_run)
        print(format_outcome(outcome, journal.location))
    return 0


if __name__ == "__main__":
    sys.exit(main())
