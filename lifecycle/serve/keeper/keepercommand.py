"""The `keeper` command: run the host's keeper of finished weights, or ask one what it holds."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from lifecycle.core.command import DEFAULT_JOURNAL_HELP, default_journal
from lifecycle.core.errors import ConfigError, LifecycleError

DESCRIPTION = """\
Hold the finished weights of each fingerprint (after --dtype and placement) for the ranks of
this host: a rank that starts attaches to them instead of reading its model from disk, and a
restart of a failed group keeps them. One keeper per host (in Kubernetes, a sidecar sharing
the pod's memory); `serve` and `boot` find it with --keeper auto (the default socket below).
Its life is journaled in the journal's keeper_log; `lifecycle keeper --status` asks a running
keeper what it holds. Messages are signed with a key derived from the artifact key
(LIFECYCLE_ARTIFACT_KEY, LIFECYCLE_ARTIFACT_KEY_FILE, or the user's own key file): the keeper
and the ranks must hold the same one.
"""


def add_keeper_command(sub: Any) -> None:
    from lifecycle.runtime.keeping.keeperwire import default_socket

    cmd = sub.add_parser(
        "keeper",
        help="hold finished weights for this host's ranks (attach instead of load)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument(
        "--socket",
        default=str(default_socket(os.environ)),
        help="the Unix socket to listen on (default: %(default)s)",
    )
    cmd.add_argument(
        "--db",
        default=default_journal(os.environ),
        help=f"journal path or URL ({DEFAULT_JOURNAL_HELP})",
    )
    cmd.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="the most it holds (bytes, or 512MiB, 8GiB...; default: half the host's memory)",
    )
    cmd.add_argument(
        "--status",
        action="store_true",
        help="print what the keeper at --socket holds, as JSON, and exit",
    )


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_keeper_command(ns: argparse.Namespace) -> int:
    from lifecycle.core.decisions.residencyplanner import parse_size
    from lifecycle.runtime.artifacts.signing import artifact_key
    from lifecycle.runtime.keeping.keeperwire import KeeperKey, KeeperUnavailable, ask
    from lifecycle.serve.cli.dbcommand import fail
    from lifecycle.serve.keeper.keeperserver import Keeper, run_keeper
    from lifecycle.store.journal import Journal

    path = Path(ns.socket)
    try:
        key = KeeperKey.derived(artifact_key(os.environ, journal=ns.db).secret)
        if ns.status:
            try:
                answer, fds = ask(path, key, {"op": "status"})
            except KeeperUnavailable as exc:
                print(f"lifecycle keeper: {exc}")
                return 1
            for fd in fds:
                os.close(fd)
            answer.pop("mac", None)
            with contextlib.suppress(BrokenPipeError):  # a reader that stopped early
                print(json.dumps(answer, indent=2), flush=True)
            return 0
        try:
            budget = (
                _host_memory() // 2 if ns.memory_budget is None else parse_size(ns.memory_budget)
            )
        except ConfigError as exc:
            raise ConfigError(
                f"--memory-budget {ns.memory_budget!r}: {exc}", field="memory_budget"
            ) from None
        journal = Journal.open_for_write(ns.db)
        try:
            return run_keeper(path, Keeper(key=key, budget_bytes=budget, journal=journal))
        finally:
            journal.close()
    except LifecycleError as exc:
        return fail(exc)
