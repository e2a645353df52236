"""The launcher: runs a startup on this process (one rank) or on spawned rank processes."""

from __future__ import annotations

import os
import signal
import sys
import threading

from lifecycle.config import ServerArgs
from lifecycle.journal import Journal
from lifecycle.progress import ProgressPrinter
from lifecycle.rank import (
    RankLaunch,
    RankSession,
    install_signal_watcher,
    new_run_id,
    run_row,
)
from lifecycle.recorder import Recorder
from lifecycle.states import State

EXIT_READY = 0
EXIT_FAILED = 1


def boot(args: ServerArgs, *, created_at: float) -> int:
    """Run a startup to ready and stop; 0 when every rank got to ready, else 1."""
    if args.num_ranks == 1:
        return _boot_in_process(args, created_at=created_at)
    from lifecycle.supervisor import boot_ranks

    return boot_ranks(args, created_at=created_at)


def serve(args: ServerArgs, *, created_at: float, host: str, port: int) -> int:
    from lifecycle.server import serve_http

    return serve_http(args, created_at=created_at, host=host, port=port)


def _boot_in_process(args: ServerArgs, *, created_at: float) -> int:
    journal = Journal.open_for_write(args.db)
    run_id = new_run_id(created_at)
    journal.create_run(run_row(args, run_id=run_id, created_at=created_at))
    recorder = Recorder(journal.writer(run_id=run_id, rank=0))
    printer = ProgressPrinter(run_created_at=created_at)
    print(f"run {run_id}  model {args.model.name}  ranks 1  journal {args.db}", flush=True)

    def show(stored: object) -> None:
        for line in printer.feed(stored):  # type: ignore[arg-type]
            print(line, flush=True)

    recorder.subscribe(show)
    session = RankSession(
        args, RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False), recorder
    )
    done = threading.Event()

    def on_signal(sig: signal.Signals) -> None:
        session.stop(reason="signal", signal_name=sig.name)
        session.close()
        sys.stdout.flush()
        os._exit(128 + int(sig))

    install_signal_watcher(on_signal)
    state = session.boot()
    if state is State.READY:
        session.stop(reason="boot complete")
    session.close()
    journal.close()
    done.set()
    return EXIT_READY if state is State.READY else EXIT_FAILED
