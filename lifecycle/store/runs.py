"""Run ids and the `runs` row of a startup."""

from __future__ import annotations

import hashlib
import secrets
import shlex
import socket
import time

from lifecycle import __version__
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow


def launch_command(argv: list[str]) -> str:
    """The command line as a shell would take it back."""
    return shlex.join(argv)


def new_run_id(now: float) -> str:
    """Sortable and readable: UTC date and time, then six random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + "-" + secrets.token_hex(3)


# The prefix of a run id derived from torchrun's rendezvous id, which says where it came from.
ELASTIC_PREFIX = "torchrun-"


def elastic_run_id(elastic_id: str, restart_count: str = "0") -> str:
    """The run id of torchrun's rendezvous `elastic_id` (TORCHELASTIC_RUN_ID) in its
    `restart_count`th attempt: the same on every rank without a collective, since each derives
    it from what torchrun set alike for all; of the one form whatever torchrun was given
    (`--rdzv-id` may be any text); and a new run for each attempt of a restarted group, whose
    ranks would otherwise append to the failed attempt's journal."""
    # surrogateescape: the environment may hold bytes that are not UTF-8, and they name it too.
    text = f"{elastic_id}\n{restart_count}".encode("utf-8", "surrogateescape")
    digest = hashlib.blake2b(text, digest_size=7)
    return ELASTIC_PREFIX + digest.hexdigest()


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
