"""SIGTERM and SIGINT handled by a thread of their own, so that a blocked rank still answers."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# Asks a rank to write its ring of collective records to the journal, as Flight Recorder
# dumps are asked for; without a handler its default action would end the process.
DUMP_SIGNAL = signal.SIGUSR1


def block_shutdown_signals() -> None:
    """Block SIGTERM and SIGINT in this thread and every thread it starts from now on.

    Call first thing in an entry point, before importing torch: its import starts native
    threads, and a thread with the signals unblocked would take them with the default action
    (death, with nothing journaled).
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {*SHUTDOWN_SIGNALS, DUMP_SIGNAL})


def watch_shutdown_signals(on_signal: Callable[[signal.Signals], None]) -> None:
    """Wait for SIGTERM or SIGINT in a daemon thread and call `on_signal` there.

    The main thread may be blocked inside a collective in C++, where a Python signal handler
    would never run; a thread in sigwait always answers. Signals that arrived while blocked
    and before this call are pending and are answered at once.
    """
    block_shutdown_signals()

    def watch() -> None:
        received = signal.sigwait(SHUTDOWN_SIGNALS)
        on_signal(signal.Signals(received))

    threading.Thread(target=watch, name="lifecycle-signals", daemon=True).start()


def watch_dump_signal(on_dump: Callable[[], None]) -> None:
    """Call `on_dump` in a daemon thread each time SIGUSR1 arrives."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {DUMP_SIGNAL})

    def watch() -> None:
        while True:
            signal.sigwait({DUMP_SIGNAL})
            on_dump()

    threading.Thread(target=watch, name="lifecycle-dump-signal", daemon=True).start()


# What must be done before the process ends at once (a bounded flush of the traces it made):
# called, each bounded by itself, by leave_process from whichever thread ends the process.
_BEFORE_LEAVING: list[Callable[[], object]] = []


def before_leaving(call: Callable[[], object]) -> None:
    """Call `call` before this process ends through leave_process."""
    _BEFORE_LEAVING.append(call)


def leave_process(status: int) -> NoReturn:
    """End this process now with `status`, from any thread: the main thread may be blocked
    in a collective or a hang for good, where nothing else would end it."""
    for call in list(_BEFORE_LEAVING):
        with contextlib.suppress(Exception):
            call()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)
