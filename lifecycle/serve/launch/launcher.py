"""The launcher: runs a startup on this process (one rank) or on spawned rank processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING

from lifecycle.core.command import SIGNAL_EXIT_BASE, Exit
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import StoredEvent
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.artifacts.signing import artifact_key
from lifecycle.runtime.group.signals import leave_process, watch_shutdown_signals
from lifecycle.runtime.keeping.keeperwire import keeper_link
from lifecycle.runtime.phases import IMPORT_RUNTIME, IMPORT_TORCH, OPEN_JOURNAL, mark
from lifecycle.runtime.recorder import Recorder
from lifecycle.serve.console.progress import ProgressPrinter
from lifecycle.serve.http.front import FrontOptions
from lifecycle.serve.logs import configure_logging, say
from lifecycle.serve.ranks.launchtime import launch_walls
from lifecycle.serve.ranks.supervisor import LaunchOptions, RankGroup, supervise
from lifecycle.serve.ranks.worker import trace_startup, under_torchrun
from lifecycle.store import shown_location
from lifecycle.store.runs import new_run_id, open_run
from lifecycle.verdict.launched import (
    LaunchedRun,
    exit_text,
    failure_reason,
    launched_verdict,
    summary_lines,
)

if TYPE_CHECKING:  # torch: imported once the journal is open, as a phase of its own
    from lifecycle.runtime.rankstart import RankLaunch


def boot(args: ServerArgs, *, created_at: float, options: LaunchOptions) -> int:
    """Run a startup to ready and stop; 0 when every rank got to ready, else 1.

    Under torchrun this process is one rank of the group; otherwise one rank runs here and
    several run as spawned processes.
    """
    refuse_unusable_key(args)
    if under_torchrun(os.environ):
        from lifecycle.serve.ranks.worker import RankEnv, run_rank_process

        try:
            ranks = RankEnv.from_env(os.environ)
        except ValueError:
            raise ConfigError(
                "RANK, WORLD_SIZE and LOCAL_WORLD_SIZE must be integers (as torchrun sets them),"
                f" not {_torchrun_env(os.environ)}",
                field="env",
            ) from None
        if ranks.world_size != args.num_ranks:
            raise ConfigError(
                f"torchrun started {ranks.world_size} ranks but --num-ranks is {args.num_ranks}",
                field="num_ranks",
            )
        return run_rank_process(args, mode="boot", env=os.environ, created_at=created_at)
    if args.num_ranks == 1:
        return _boot_in_process(args, created_at=created_at, options=options)
    return boot_ranks(args, created_at=created_at, options=options)


def serve(
    args: ServerArgs, *, created_at: float, options: LaunchOptions, front: FrontOptions
) -> int:
    """Boot the ranks as processes of their own and serve HTTP here until SIGTERM, or until
    `front.linger_s` after a fatal startup failure (then exit 1, so that a pod restarts). Under
    torchrun this process is one rank of the group, and rank 0 serves HTTP."""
    refuse_unusable_key(args)
    if under_torchrun(os.environ):
        from lifecycle.serve.launch.nodeserve import serve_under_torchrun

        return serve_under_torchrun(args, created_at=created_at, front=front)
    from lifecycle.serve.http.server import serve_http

    return serve_http(args, created_at=created_at, options=options, front=front)


def refuse_unusable_key(args: ServerArgs) -> None:
    """An artifact key that cannot be used (LIFECYCLE_ARTIFACT_KEY too short, the file
    LIFECYCLE_ARTIFACT_KEY_FILE names missing or open to others): ConfigError, one line, before
    the journal is opened or a rank starts, where the startup would use it: --compile signs
    and checks artifacts with it, and a keeper's messages are signed with a key derived from
    it (--keeper PATH, or auto where the host's keeper socket is there)."""
    if args.enable_torch_compile:
        artifact_key(os.environ, journal=args.db)
    keeper_link(args.keeper, journal=args.db, env=os.environ)


def _torchrun_env(env: Mapping[str, str]) -> str:
    names = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    return " ".join(f"{name}={env[name]!r}" for name in names if name in env)


def _alone(run_id: str, *, created_at: float) -> RankLaunch:
    """The launch of a boot that is its own single rank, in this process (torch imported)."""
    from lifecycle.runtime.rankstart import RankLaunch

    launched_at, process_started_at = launch_walls(os.environ, entered_at=created_at)
    return RankLaunch(
        run_id=run_id,
        rank=0,
        local_ranks=1,
        distributed=False,
        launcher_started_wall=launched_at,
        process_started_wall=process_started_at,
    )


def _boot_in_process(args: ServerArgs, *, created_at: float, options: LaunchOptions) -> int:
    run_id = new_run_id(created_at)
    journal = open_run(args, run_id=run_id, created_at=created_at, command=options.command)
    mark(OPEN_JOURNAL)
    # Imported once the journal is open: a journal that cannot be is one line in a second,
    # not after torch's import.
    import torch  # noqa: F401  (its import is a phase of its own)

    mark(IMPORT_TORCH)
    from lifecycle.runtime.session import RankSession
    from lifecycle.serve.console.steps import StepMark, counting_actions
    from lifecycle.serve.console.terminal import boot_console

    mark(IMPORT_RUNTIME)

    recorder = Recorder(journal.writer(run_id=run_id, rank=0))
    trace_startup(recorder, run_id=run_id, rank=0, model=args.model.name, env=os.environ)
    console = boot_console(ProgressPrinter(run_created_at=created_at), ranks=1)
    logs = console.log_stream()
    if logs is not None:  # this process's own logs go above the bar, not through it
        configure_logging(json=options.json_logs, level=options.log_level, stream=logs)
    console.show(
        [f"run {run_id}  model {args.model.name}  ranks 1  journal {shown_location(args.db)}"]
    )
    recorder.subscribe(console.feed)
    launch = _alone(run_id, created_at=created_at)

    def on_step(done: int, steps: int, stage: str | None) -> None:
        mark = StepMark(state=session.machine.state, done=done, steps=steps, stage=stage)
        console.steps({0: mark})

    session = RankSession(args, launch, recorder, actions=counting_actions(on_step))

    def on_signal(sig: signal.Signals) -> None:
        status = session.shutdown_by_signal(sig)
        console.close()
        sys.stdout.flush()
        leave_process(status)

    watch_shutdown_signals(on_signal)
    try:
        state = session.boot()
        if session.refused is not None:
            console.close()
            say(f"lifecycle: error: {session.refused}", event="error", out=sys.stderr)
            session.close()
            journal.close()
            return Exit.USAGE
        if state is State.READY:
            session.stop(reason="boot complete")
        session.close()
        journal.close()
    finally:
        console.close()
    return Exit.OK if state is State.READY else Exit.FAILED


def _boot_result(
    reason: str | None,
    codes: list[int | None],
    *,
    unjournaled: list[int],
    interrupted: list[signal.Signals],
) -> tuple[int, str]:
    """The boot's exit status, and why in words."""
    if unjournaled:
        # Above a failure or a signal: what the journal holds of this startup is incomplete.
        return Exit.UNJOURNALED, f"journal not written by rank {', '.join(map(str, unjournaled))}"
    if interrupted:
        return SIGNAL_EXIT_BASE + int(interrupted[0]), f"interrupted by {interrupted[0].name}"
    if Exit.USAGE in codes:
        # A rank refused what it was given (a plug-in's pipeline it built): bad input, as the
        # launcher's own refusals are.
        return Exit.USAGE, f"bad input: {reason}"
    return (Exit.OK if reason is None else Exit.FAILED), reason or "every rank got to ready"


def boot_ranks(args: ServerArgs, *, created_at: float, options: LaunchOptions) -> int:
    """`lifecycle boot --num-ranks N`: 0 when every rank got to ready, else 1."""
    spec = options.worker_spec(args, mode="boot")
    group = RankGroup(args, created_at=created_at, spec=spec)
    from lifecycle.serve.console.terminal import boot_console

    printer = ProgressPrinter(run_created_at=created_at, ranks=args.num_ranks)
    console = boot_console(printer, ranks=args.num_ranks)
    console.show(
        [
            f"run {group.run_id}  model {args.model.name}  ranks {args.num_ranks}"
            f" (cfg {args.cfg_parallel} x ulysses {args.ulysses})"
            f"  journal {shown_location(args.db)}"
        ]
    )
    interrupted: list[signal.Signals] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        interrupted.append(signal.Signals(signum))

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        group.start(stderr_of=console.rank_stderr)

        def show(events: list[StoredEvent]) -> None:
            for stored in events:
                console.feed(stored)
            console.steps(group.steps())

        supervise(group, on_events=show, keep_going=lambda: not interrupted)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        console.close()
    # supervise() returns once every rank process has ended and the journal was read after
    # that: these views hold everything each rank committed.
    views = group.views()
    codes = group.exit_codes()
    group.close()
    unjournaled = [rank for rank, code in enumerate(codes) if code == Exit.UNJOURNALED]
    # The culprit `replay diagnose` names leads the reason, not the first rank to fail: that
    # is often a victim (its collective timed out waiting on the rank that hung).
    run = LaunchedRun.of(args, run_id=group.run_id, created_at=created_at)
    verdict = launched_verdict(run, views, codes, now=time.time())
    reason = failure_reason(verdict, views, codes)
    status, why = _boot_result(reason, codes, unjournaled=unjournaled, interrupted=interrupted)
    for line in summary_lines(views, codes, created_at=created_at):
        say(line, event="rank-summary")
    say(f"boot: {exit_text(status)}: {why}", event="boot-result", exit_status=status, why=why)
    if unjournaled:
        say(
            f"lifecycle: error: journal {shown_location(args.db)} could not be written by rank"
            f" {', '.join(map(str, unjournaled))}: the startup stopped and its record is"
            " incomplete",
            event="error",
            out=sys.stderr,
        )
    return status
