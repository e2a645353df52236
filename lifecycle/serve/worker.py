"""A rank process, under the launcher or under torchrun: boot, then stop or serve requests."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import TYPE_CHECKING, Any

from lifecycle.core.command import SIGNAL_EXIT_BASE, Exit
from lifecycle.core.config import PeerFailure, ServerArgs, args_from_json
from lifecycle.core.errors import (
    LifecycleError,
    PeerGone,
    RequestAborted,
    RequestStalled,
    classify,
)
from lifecycle.core.records import shared_fields
from lifecycle.core.runid import checked_run_id
from lifecycle.core.states import State
from lifecycle.core.validation import validate_shape
from lifecycle.runtime.signals import (
    block_shutdown_signals,
    leave_process,
    watch_dump_signal,
    watch_shutdown_signals,
)
from lifecycle.serve.control import (
    ControlInbox,
    Hello,
    Line,
    Lost,
    Progress,
    Ready,
    Result,
    Stop,
)
from lifecycle.serve.crossnode import RankBridge
from lifecycle.serve.launchtime import launch_walls
from lifecycle.serve.logs import configure_logging, say
from lifecycle.serve.models import register_model

# RUN_ID_ENV, RankEnv and under_torchrun are re-exported: the launcher, the supervisor and the
# command line take them from the rank's entry, where they were first defined.
from lifecycle.serve.rankenv import RUN_ID_ENV as RUN_ID_ENV  # noqa: PLC0414
from lifecycle.serve.rankenv import RankEnv as RankEnv  # noqa: PLC0414
from lifecycle.serve.rankenv import named_run_id
from lifecycle.serve.rankenv import under_torchrun as under_torchrun  # noqa: PLC0414

if TYPE_CHECKING:
    from lifecycle.runtime.recorder import Recorder
    from lifecycle.runtime.session import RankSession

# This module is the entry of rank processes and is imported by the launcher: it imports
# torch (through lifecycle.runtime.session) only inside functions, after the shutdown signals
# are blocked.

WORKER_ENV = "LIFECYCLE_WORKER"
# A failed rank stays this long past the process-group timeout at most, so that peers blocked
# on it time out themselves (as under NCCL) and journal where they were.
LINGER_MARGIN_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """What the launcher tells each rank process, through the environment."""

    config: dict[str, Any]
    mode: str  # "boot" or "serve"
    pipeline: str | None = None
    control_host: str | None = None
    control_port: int | None = None
    control_authkey: str | None = None
    json_logs: bool = False
    log_level: str = "info"
    command: str | None = None

    def to_env(self) -> str:
        return json.dumps(
            {
                "config": self.config,
                "mode": self.mode,
                "pipeline": self.pipeline,
                "control_host": self.control_host,
                "control_port": self.control_port,
                "control_authkey": self.control_authkey,
                "json_logs": self.json_logs,
                "log_level": self.log_level,
                "command": self.command,
            }
        )

    @classmethod
    def from_env(cls, text: str) -> WorkerSpec:
        doc = json.loads(text)
        return cls(**doc)


def _agreed_run_id(
    env: Mapping[str, str], created_at: float, ranks: RankEnv, args: ServerArgs
) -> str:
    """The launcher's run id, else torchrun's rendezvous id, else rank 0's, broadcast."""
    from lifecycle.store.runs import new_run_id

    named = named_run_id(env)
    if named is not None:
        return named
    if ranks.world_size == 1:
        return new_run_id(created_at)
    import torch
    import torch.distributed as dist

    from lifecycle.runtime.device import select_device
    from lifecycle.runtime.flightrecorder import folder_for, turn_on
    from lifecycle.runtime.process_group import join_process_group

    # No shared id in the environment: join the group first and let rank 0 name the run.
    device = select_device(args.device, local_rank=ranks.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The run's folder is not known yet: NCCL's own dumps go to the folder above it.
    turn_on(os.environ, entries=args.flight_recorder_entries, folder=folder_for(args))
    join_process_group(
        device=device,
        rank=ranks.rank,
        world_size=ranks.world_size,
        dist_timeout_s=args.dist_timeout_s,
        env=env,
    )
    chosen = [new_run_id(created_at) if ranks.rank == 0 else ""]
    dist.broadcast_object_list(chosen, src=0)
    return checked_run_id(str(chosen[0]), source="rank 0")


def run_rank_process(
    args: ServerArgs,
    *,
    mode: str,
    env: Mapping[str, str],
    created_at: float,
    control: Connection | Line | None = None,
    on_journal: Callable[[str, Recorder], object] | None = None,
    leave: Callable[[int], None] = leave_process,
    before_signal_exit: Callable[[signal.Signals], object] | None = None,
) -> int:
    """One rank from start to exit; returns the process exit status. `created_at` is
    time.time() at the process's entry; `on_journal(run_id, recorder)` is called once the
    rank's journal is open, before its first event; `leave(status)` ends the process from
    another thread (an agreed abort, a startup timeout); `before_signal_exit(sig)` is
    called on a shutdown signal once the session exists, before the rank journals it."""
    from lifecycle.runtime.actions import STARTUP_ACTIONS
    from lifecycle.runtime.process_group import leave_process_group
    from lifecycle.runtime.recorder import Recorder, clock_for
    from lifecycle.runtime.session import RankLaunch, RankSession
    from lifecycle.serve.steps import counting_actions, pipe_report
    from lifecycle.store.runs import launch_command, open_run

    ranks = RankEnv.from_env(env)
    clock = clock_for(ranks.rank, env, world_size=ranks.world_size)
    stop = threading.Event()
    started: list[RankSession] = []

    def on_signal(sig: signal.Signals) -> None:
        stop.set()
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
            before_signal_exit(sig)
        os._exit(started[0].shutdown_by_signal(sig))

    watch_shutdown_signals(on_signal)
    run_id = _agreed_run_id(env, created_at, ranks, args)
    journal = open_run(args, run_id=run_id, created_at=created_at, command=launch_command(sys.argv))
    recorder = Recorder(journal.writer(run_id=run_id, rank=ranks.rank), clock=clock)
    if on_journal is not None:
        on_journal(run_id, recorder)
    launched_at, process_started_at = launch_walls(env, entered_at=created_at)
    launch = RankLaunch(
        run_id=run_id,
        rank=ranks.rank,
        local_ranks=ranks.local_world_size,
        distributed=ranks.world_size > 1,
        launcher_started_wall=launched_at,
        process_started_wall=process_started_at,
    )
    # Steps go to the launcher's console through a pipe of its own, never the journal.
    report = pipe_report(env, lambda: session.machine.state)
    actions = STARTUP_ACTIONS if report is None else counting_actions(report)
    console = None
    if mode == "boot" and ranks.rank == 0 and WORKER_ENV not in env:
        # No launcher of ours prints the table under torchrun: rank 0 prints its own, in
        # plain lines (the other ranks' processes share the terminal).
        from lifecycle.serve.console import PlainConsole
        from lifecycle.serve.progress import ProgressPrinter
        from lifecycle.store import shown_location

        console = PlainConsole(ProgressPrinter(run_created_at=created_at))
        console.show(
            [f"run {run_id}  model {args.model.name}  ranks {ranks.world_size} (torchrun)"
             f"  journal {shown_location(args.db)}"]
        )  # fmt: skip
        recorder.subscribe(console.feed)
    session = RankSession(args, launch, recorder, actions=actions, leave=leave)
    started.append(session)
    watch_dump_signal(lambda: session.dump_ring("signal"))
    state = session.boot()
    if session.disagreement is not None:
        # Every rank saw the same settings at the rendezvous and fails on them at once: none
        # waits on a peer, so none lingers; bad input, as a flag refused at start is.
        say(
            f"lifecycle: error: rank {ranks.rank}: {session.disagreement}",
            event="error",
            out=sys.stderr,
            rank=ranks.rank,
        )
        session.close()
        leave_process_group()
        return Exit.USAGE
    if state is State.READY:
        if mode == "serve" and control is not None:
            _serve(session, control)
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


# A peer that gave up a request for a stop hangs up on the collective this rank waits in;
# the same stop reaches this rank at about the same time, and is waited for this long before
# the hang-up is taken for a failure.
PEER_STOP_GRACE_S = 2.0


def _serve(session: RankSession, control: Connection | Line) -> None:
    """Answer the launcher's requests until it says stop or the rank fails."""
    from lifecycle.core.errors import CollectiveError, CollectiveTimeout
    from lifecycle.runtime.actions import generate

    runtime = session.runtime
    assert runtime is not None
    rank = session.launch.rank
    inbox = ControlInbox(
        control,
        on_dump=session.dump_ring,
        on_given_up=lambda given: session.fail(
            RequestStalled(request_id=given.request_id, silent_s=given.silent_s),
            where=f"the server gave request {given.request_id} up",
        ),
        on_lost=lambda lost: session.fail(
            PeerGone(lost.why, group="control", group_seq=0, op="broadcast"), where=lost.why
        ),
    )
    session.serve_collectives_from_ring()
    if isinstance(control, RankBridge):
        control.join_control_group()  # every rank at once, as it enters its serve loop
    inbox.send(Ready(rank=rank))
    served = 0
    while True:
        message = inbox.next()
        if isinstance(message, Stop):
            session.stop(reason=message.reason, signal_name=message.signal)
            return
        if isinstance(message, Lost):
            return  # failed (or aborted) by the reader thread
        if inbox.stopping:
            continue
        request_id = message.request_id
        served += 1

        def after_step(
            step: int,
            request_id: str = request_id,
            nth: int = served,
            half_way: int = max(1, message.request.steps // 2),
        ) -> None:
            if inbox.stopping:
                raise RequestAborted(
                    request_id=request_id, step=step, reason=inbox.stop_message.reason
                )
            if step + 1 == half_way:
                session.faults.inject_in_request(nth)
            inbox.send(Progress(request_id=request_id, rank=rank, step=step))

        try:
            request = message.request
            validate_shape(session.args.model, request.shape, request.steps)
            generated = generate(
                runtime,
                request,
                source="http",
                request_id=request_id,
                keep_video=message.return_video,
                after_step=after_step,
            )
            video = None if generated.video is None else generated.video.numpy()
            inbox.send(
                Result(
                    request_id=request_id,
                    rank=rank,
                    ok=True,
                    video=video,
                    **shared_fields(generated.result, Result),
                )
            )
        except Exception as exc:  # the request failed on this rank: journal it, fail, report
            hung_up = isinstance(exc, CollectiveError) and not isinstance(exc, CollectiveTimeout)
            stopped = (
                isinstance(exc, RequestAborted)
                or inbox.stopping
                or (hung_up and inbox.wait_for_stop(PEER_STOP_GRACE_S))
            )
            if stopped:
                # Given up for a stop, here or on a peer: a shutdown, not a failure.
                stop = inbox.stop_message
                session.stop(reason=stop.reason, signal_name=stop.signal)
                return
            session.fail(exc)
            error = f"{type(exc).__name__}: {exc}"
            inbox.send(
                Result(
                    request_id=request_id,
                    rank=rank,
                    ok=False,
                    error=error,
                    error_kind=classify(exc),
                )
            )
            return


def main() -> int:
    """Entry of a rank process spawned by the launcher (`python -m lifecycle.serve.worker`)."""
    created_at = time.time()
    block_shutdown_signals()
    spec = WorkerSpec.from_env(os.environ[WORKER_ENV])
    configure_logging(json=spec.json_logs, level=spec.log_level)
    try:
        if spec.pipeline:
            from lifecycle.runtime.pipeline import load_plugin

            load_plugin(spec.pipeline)
        args = args_from_json(spec.config)
        register_model(args.model)
        control = None
        if spec.mode == "serve" and spec.control_port is not None:
            assert spec.control_host is not None and spec.control_authkey is not None
            control = Client(
                (spec.control_host, spec.control_port),
                authkey=bytes.fromhex(spec.control_authkey),
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
    os._exit(status)


if __name__ == "__main__":
    main()
