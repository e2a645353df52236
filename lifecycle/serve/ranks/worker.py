"""A rank process, under the launcher or under torchrun: boot, then stop or serve requests."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING

from lifecycle.core.command import SIGNAL_EXIT_BASE, Exit
from lifecycle.core.errors import (
    LifecycleError,
)
from lifecycle.core.format.events import ActionFinished, StoredEvent
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import PeerFailure, ServerArgs, args_from_json
from lifecycle.runtime.group.signals import (
    before_leaving,
    block_shutdown_signals,
    leave_process,
    watch_dump_signal,
    watch_shutdown_signals,
)
from lifecycle.runtime.phases import (
    AGREE_RUN_ID,
    IMPORT_LIFECYCLE,
    IMPORT_RUNTIME,
    IMPORT_TORCH,
    MODEL_SPEC,
    OPEN_JOURNAL,
    mark,
)
from lifecycle.serve.logs import configure_logging, say
from lifecycle.serve.ranks.control import Line, LockedConnection
from lifecycle.serve.ranks.launchtime import launch_walls
from lifecycle.serve.ranks.messages import Hello, Rejected
from lifecycle.serve.ranks.modeldtype import register_dtype
from lifecycle.serve.ranks.models import register_model

# RankEnv and under_torchrun are re-exported: the launcher and the command line take them from
# the rank's entry, where they were first defined.
from lifecycle.serve.ranks.rankenv import WORKER_ENV, WorkerSpec, agreed_run_id, named_run_id
from lifecycle.serve.ranks.rankenv import RankEnv as RankEnv  # noqa: PLC0414
from lifecycle.serve.ranks.rankenv import under_torchrun as under_torchrun  # noqa: PLC0414
from lifecycle.serve.ranks.rankserve import serve_requests

if TYPE_CHECKING:
    from lifecycle.runtime.clock import Clock
    from lifecycle.runtime.group.storetrust import StoreTrust
    from lifecycle.runtime.recorder import Recorder
    from lifecycle.runtime.session import RankLaunch, RankSession

# This module is the entry of rank processes and is imported by the launcher: it imports
# torch (through lifecycle.runtime.session) only inside functions, after the shutdown signals
# are blocked.

UNAUTHENTICATED = (
    "lifecycle: warning: the rendezvous store is unauthenticated (no LIFECYCLE_STORE_KEY or"
    " LIFECYCLE_STORE_KEY_FILE): whatever reaches it can end or steer this run"
)
# A failed rank stays this long past the process-group timeout at most, so that peers blocked
# on it time out themselves (as under NCCL) and journal where they were.
LINGER_MARGIN_S = 10.0


def run_rank_process(
    args: ServerArgs,
    *,
    mode: str,
    env: Mapping[str, str],
    created_at: float,
    control: Connection | Line | None = None,
    on_journal: Callable[[str, Recorder, StoreTrust], object] | None = None,
    leave: Callable[[int], None] = leave_process,
    before_signal_exit: Callable[[signal.Signals, RankSession], object] | None = None,
) -> int:
    """One rank from start to exit; returns the process exit status. `created_at` is
    time.time() at the process's entry; `on_journal(run_id, recorder, trust)` is called once
    the rank's journal is open, before its first event (`trust`: how the rank opens what it
    reads from the rendezvous store); `leave(status)` ends the process from
    another thread (an agreed abort, a startup timeout); `before_signal_exit(sig, session)`
    is called on a shutdown signal once the session exists, before the rank journals it."""
    import torch  # noqa: F401  (its import is a phase of its own)

    mark(IMPORT_TORCH)
    # The modules a rank runs on, imported here as a phase of their own; the functions below
    # that use process_group and runs take their names from them again, at no cost.
    from lifecycle.runtime.actions import STARTUP_ACTIONS
    from lifecycle.runtime.clock import clock_for
    from lifecycle.runtime.group import process_group  # noqa: F401
    from lifecycle.runtime.group.storetrust import store_secret
    from lifecycle.runtime.session import RankSession
    from lifecycle.serve.console.steps import counting_actions, pipe_report
    from lifecycle.store import runs  # noqa: F401

    mark(IMPORT_RUNTIME)

    ranks = RankEnv.from_env(env)
    clock = clock_for(ranks.rank, env, world_size=ranks.world_size)
    secret = store_secret(env)
    stop = threading.Event()
    started: list[RankSession] = []
    pending: list[signal.Signals] = []  # a shutdown signal that came before the session
    watch_shutdown_signals(
        _on_shutdown_signal(env, ranks, stop, started, pending, before_signal_exit)
    )
    run_id, recorder, trust = _open_rank_journal(
        args, env, ranks, created_at=created_at, clock=clock, secret=secret, control=control
    )
    if on_journal is not None:
        on_journal(run_id, recorder, trust)
    launch = _rank_launch(run_id, ranks, env=env, created_at=created_at)
    # Steps go to the launcher's console through a pipe of its own, never the journal.
    report = pipe_report(env, lambda: session.machine.state)
    actions = STARTUP_ACTIONS if report is None else counting_actions(report)
    if mode == "boot" and ranks.rank == 0 and WORKER_ENV not in env:
        _show_torchrun_boot(recorder, args, run_id=run_id, ranks=ranks, created_at=created_at)
    session = RankSession(args, launch, recorder, actions=actions, leave=leave, trust=trust)
    started.append(session)
    if pending:
        leave_process(session.shutdown_before_start(pending[0]))
    watch_dump_signal(lambda: session.dump_ring("signal"))
    state = session.boot()
    return _exit_status(session, state, args, ranks, mode=mode, control=control, stop=stop)


def _on_shutdown_signal(
    env: Mapping[str, str],
    ranks: RankEnv,
    stop: threading.Event,
    started: list[RankSession],
    pending: list[signal.Signals],
    before_signal_exit: Callable[[signal.Signals, RankSession], object] | None,
) -> Callable[[signal.Signals], None]:
    """What a shutdown signal does to the rank: `stop` is set; the signal is journaled by its
    session (`started`), or held in `pending` until its journal opens, or said where no journal
    will record it."""

    def on_signal(sig: signal.Signals) -> None:
        stop.set()
        if not started and named_run_id(env) is not None:
            # The run is known and the journal opens in a moment: the stop is journaled then.
            pending.append(sig)
            return
        if not started:
            # Before the session: the ranks may still be joining the group to agree on a run
            # id, which would hold this one until the rendezvous timeout, and no journal is
            # open yet to record the stop in.
            say(
                f"lifecycle: rank {ranks.rank}: stopped by {sig.name} before its journal was"
                " open (the ranks were agreeing on a run id): nothing journaled",
                event="rank-stopped-unjournaled",
                out=sys.stderr,
                rank=ranks.rank,
            )
            leave_process(SIGNAL_EXIT_BASE + int(sig))
        if before_signal_exit is not None:
            before_signal_exit(sig, started[0])
        leave_process(started[0].shutdown_by_signal(sig))

    return on_signal


def _open_rank_journal(
    args: ServerArgs,
    env: Mapping[str, str],
    ranks: RankEnv,
    *,
    created_at: float,
    clock: Clock,
    secret: bytes | None,
    control: Connection | Line | None,
) -> tuple[str, Recorder, StoreTrust]:
    """The run's id, agreed by the ranks, and this rank's recorder on its journal, with how it
    trusts what it reads from the rendezvous store (sealed with `secret`)."""
    from lifecycle.runtime.group.storetrust import Rejections, RunKey, StoreTrust
    from lifecycle.runtime.recorder import Recorder
    from lifecycle.store.runs import launch_command, open_run

    run_id = agreed_run_id(env, created_at, ranks, args, secret)
    if ranks.world_size > 1 and named_run_id(env) is None:
        mark(AGREE_RUN_ID)  # the ranks joined their group to agree on it
    journal = open_run(args, run_id=run_id, created_at=created_at, command=launch_command(sys.argv))
    mark(OPEN_JOURNAL)
    recorder = Recorder(journal.writer(run_id=run_id, rank=ranks.rank), clock=clock)
    trust = StoreTrust(RunKey(secret, run_id=run_id), Rejections(record=recorder.record))
    if secret is None and ranks.world_size > 1 and ranks.local_rank == 0:
        recorder.subscribe(_warn_unauthenticated())
    if control is not None:
        trust.rejections.on_count(_reporter(control, ranks.rank))
    trace_startup(recorder, run_id=run_id, rank=ranks.rank, model=args.model.name, env=env)
    return run_id, recorder, trust


def _rank_launch(
    run_id: str, ranks: RankEnv, *, env: Mapping[str, str], created_at: float
) -> RankLaunch:
    """This rank's place in the run, and when its launcher and its process started."""
    from lifecycle.runtime.session import RankLaunch

    launched_at, process_started_at = launch_walls(env, entered_at=created_at)
    return RankLaunch(
        run_id=run_id,
        rank=ranks.rank,
        local_ranks=ranks.local_world_size,
        distributed=ranks.world_size > 1,
        launcher_started_wall=launched_at,
        process_started_wall=process_started_at,
    )


def _show_torchrun_boot(
    recorder: Recorder, args: ServerArgs, *, run_id: str, ranks: RankEnv, created_at: float
) -> None:
    """Print the startup's table from rank 0 of a `boot` under torchrun."""
    # No launcher of ours prints the table under torchrun: rank 0 prints its own, in
    # plain lines (the other ranks' processes share the terminal).
    from lifecycle.serve.console.progress import ProgressPrinter
    from lifecycle.serve.console.terminal import PlainConsole
    from lifecycle.store import shown_location

    console = PlainConsole(ProgressPrinter(run_created_at=created_at))
    console.show(
        [f"run {run_id}  model {args.model.name}  ranks {ranks.world_size} (torchrun)"
         f"  journal {shown_location(args.db)}"]
    )  # fmt: skip
    recorder.subscribe(console.feed)


def _exit_status(
    session: RankSession,
    state: State,
    args: ServerArgs,
    ranks: RankEnv,
    *,
    mode: str,
    control: Connection | Line | None,
    stop: threading.Event,
) -> int:
    """Serve or stop a rank that booted to `state`, or end one that did not; returns the
    process exit status."""
    from lifecycle.runtime.group.process_group import leave_process_group

    refused = session.disagreement or session.refused
    if refused is not None:
        # Every rank saw the same settings at the rendezvous (or built the same pipeline) and
        # fails on them at once: none waits on a peer, so none lingers; bad input, as a flag
        # refused at start is.
        say(
            f"lifecycle: error: rank {ranks.rank}: {refused}",
            event="error",
            out=sys.stderr,
            rank=ranks.rank,
        )
        session.close()
        leave_process_group()
        return Exit.USAGE
    if state is State.READY:
        if mode == "serve" and control is not None:
            serve_requests(session, control)
        else:
            session.stop(reason="boot complete")
        session.close()
        leave_process_group()
        return Exit.OK if session.machine.state is State.STOPPED else Exit.FAILED
    if ranks.world_size > 1 and args.on_peer_failure is PeerFailure.WAIT:
        # As under NCCL without an abort: the peers blocked on this rank time out themselves.
        session.linger(args.dist_timeout_s + LINGER_MARGIN_S, until=stop)
    session.close()
    return Exit.FAILED


def trace_startup(
    recorder: Recorder, *, run_id: str, rank: int, model: str, env: Mapping[str, str]
) -> None:
    """Send this rank's startup to the tracing collector the OTEL_* variables name, if any:
    its events are held as they are recorded and become spans once the startup is over (the
    SDK is imported then, off the path to ready), sent within a bounded time at the process's
    end at the latest."""
    from lifecycle.runtime.telemetry.rankspans import RankSpans
    from lifecycle.runtime.telemetry.tracing import Tracing

    def warn(text: str) -> None:
        say(f"lifecycle: warning: rank {rank}: {text}", event="otel-warning", out=sys.stderr)

    tracing = Tracing.deferred(env, warn=warn if rank == 0 else lambda _text: None)
    if tracing is None:
        return
    spans = RankSpans(tracing, run_id=run_id, rank=rank, attributes={"model": model})
    recorder.subscribe(spans)
    before_leaving(spans.close)


def _warn_unauthenticated() -> Callable[[StoredEvent], None]:
    """A recorder listener that says once, when the rank has joined its group (from then on it
    reads the store), that the store is unauthenticated: one line per host."""
    said = threading.Event()

    def listen(stored: StoredEvent) -> None:
        event = stored.event
        if (
            isinstance(event, ActionFinished)
            and event.action == "init-process-group"
            and event.ok
            and not said.is_set()
        ):
            said.set()
            say(UNAUTHENTICATED, event="store-unauthenticated", out=sys.stderr)

    return listen


def _reporter(control: Connection | Line, rank: int) -> Callable[[str, int], None]:
    """Tell the server each new count of messages this rank dropped (for /metrics)."""

    def report(channel: str, total: int) -> None:
        try:
            control.send(Rejected(rank=rank, channel=channel, total=total))
        except OSError:
            return  # the server is gone: the rank learns it from its inbox

    return report


def main() -> int:
    """Entry of a rank process the launcher spawned (`python -m lifecycle.serve.ranks.worker`)."""
    created_at = time.time()
    mark(IMPORT_LIFECYCLE, at=created_at)
    block_shutdown_signals()
    spec = WorkerSpec.from_env(os.environ[WORKER_ENV])
    configure_logging(json=spec.json_logs, level=spec.log_level)
    try:
        if spec.pipeline:
            from lifecycle.runtime.pipeline import load_plugin

            load_plugin(spec.pipeline)
        args = args_from_json(spec.config)
        register_model(args.model)
        register_dtype(args.model, args.dtype)
        mark(MODEL_SPEC)
        control = None
        if spec.mode == "serve" and spec.control_port is not None:
            assert spec.control_host is not None and spec.control_authkey is not None
            control = LockedConnection(
                Client(
                    (spec.control_host, spec.control_port),
                    authkey=bytes.fromhex(spec.control_authkey),
                )
            )
            control.send(Hello(rank=int(os.environ.get("RANK", "0"))))
        status = run_rank_process(
            args, mode=spec.mode, env=os.environ, created_at=created_at, control=control
        )
    except LifecycleError as exc:
        # One write: the ranks of a launcher share its stderr.
        rank = os.environ.get("RANK", "?")
        say(f"lifecycle: error: rank {rank}: {exc}", event="error", out=sys.stderr, rank=rank)
        status = exc.exit_status
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a failed gloo group can abort in its destructor.
    leave_process(status)


if __name__ == "__main__":
    main()
