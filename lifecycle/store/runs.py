"""Run ids and the `runs` row of a startup."""

from __future__ import annotations

import secrets
import shlex
import socket
import time

from lifecycle import __version__
from lifecycle.core.config import ServerArgs, args_to_json
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow


def launch_command(argv: list[str]) -> str:
    """The command line as a shell would take it back."""
    return shlex.join(argv)


def new_run_id(now: float) -> str:
    """Sortable and readable: UTC date and time, then six random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)


def run_row(
    args: ServerArgs, *, run_id: str, created_at: float, command: str | None = None
) -> RunRow:
    return RunRow(
        run_id=run_id,
        created_at=created_at,
        host=socket.gethostname(),
        world_size=args.num_ranks,
        config=args_to_json(args),
        lifecycle_version=__version__,
        command=command,
    )


def open_run(
    args: ServerArgs, *, run_id: str, created_at: float, command: str | None = None
) -> Journal:
    """Open the journal for writing and record the run (a no-op when another rank already
    did): the one way a startup begins its journal."""
    journal = Journal.open_for_write(args.db)
    try:
        journal.create_run(run_row(args, run_id=run_id, created_at=created_at, command=command))
    except BaseException:
        journal.close()
        raise
    return journal
