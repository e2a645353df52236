"""One rank's startup: the machine driven through its states, every step journaled first."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping

import torch

from lifecycle.core.command import SIGNAL_EXIT_BASE, Exit
from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.errors import (
    COLLECTIVE_KINDS,
    ConfigError,
    JournalError,
    JournalWriteFailed,
    RankDisagreement,
    RankLost,
    StartupTimeout,
    classify,
)
from lifecycle.core.format.events import (
    Aborted,
    ActionFinished,
    ActionStarted,
    ClockAligned,
    Shutdown,
    Transition,
    error_event,
)
from lifecycle.core.format.states import (
    TERMINAL_STATES,
    TRANSITIONS,
    Edge,
    State,
    Trigger,
    happy_trigger,
)
from lifecycle.core.settings.config import PeerFailure, RankLayout, ServerArgs
from lifecycle.runtime.actions import STARTUP_ACTIONS, Action, action_runs
from lifecycle.runtime.device import memory_meter, select_device
from lifecycle.runtime.group.abort import AbortWatcher, Failure, failure_of, watch_peers
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.group.flightrecorder import FlightDumper, folder_for, turn_on
from lifecycle.runtime.group.heartbeat import HeartbeatThread
from lifecycle.runtime.group.process_group import (
    fatal_error,
    join_process_group,
    measure_clock_offset,
    settings_disagreement,
)
from lifecycle.runtime.group.signals import leave_process
from lifecycle.runtime.group.storetrust import Rejections, RunKey, StoreTrust
from lifecycle.runtime.injection import RankFaults
from lifecycle.runtime.rankruntime import RankRuntime

# RankLaunch is re-exported: the launcher and the tests make a rank's session from here.
from lifecycle.runtime.rankstart import RankLaunch as RankLaunch  # noqa: PLC0414
from lifecycle.runtime.rankstart import run_started
from lifecycle.runtime.recorder import Recorder


class RankSession:
    """Drives one rank from `created` to `ready` (or `failed`) and keeps it there.

    A rank whose journal cannot be written stops at once (`leave` with exit status 3): it could
    record nothing more of what it does. One not ready within the startup timeout journals
    that and fails (`leave` with 1).
    """

    def __init__(
        self,
        args: ServerArgs,
        launch: RankLaunch,
        recorder: Recorder,
        *,
        actions: Mapping[State, tuple[tuple[str, Action], ...]] = STARTUP_ACTIONS,
        table: tuple[Edge, ...] = TRANSITIONS,
        leave: Callable[[int], None] = leave_process,
        trust: StoreTrust | None = None,
    ) -> None:
        self.args = args
        self.launch = launch
        self.recorder = recorder
        # What this rank reads from the rendezvous store is opened with the run's key.
        self.trust = trust or StoreTrust(
            RunKey(None, run_id=launch.run_id), Rejections(record=recorder.record)
        )
        self.actions = actions
        self._leave = leave
        self._leaving = threading.Lock()
        self.layout = RankLayout(
            rank=launch.rank, cfg_parallel=args.cfg_parallel, ulysses=args.ulysses
        )
        self._fire_lock = threading.RLock()
        self.runtime: RankRuntime | None = None
        self.faults = RankFaults(
            args,
            rank=launch.rank,
            recorder=recorder,
            state_of=lambda: self.machine.state,
            runtime_of=lambda: self.runtime,
        )
        # The ranks were started with different settings: bad input, not a rank's failure.
        self.disagreement: RankDisagreement | None = None
        # Bad input the rank found itself (a plug-in's pipeline that does not follow the
        # protocol, a model's component that cannot be loaded): it exits 2, as the launcher's
        # own refusals do.
        self.refused: ConfigError | None = None
        # The agreed abort (--on-peer-failure abort): the peers' failures, once joined.
        self.peers: AbortWatcher | None = None
        self.machine = LifecycleMachine(
            before=self._journal_transition,
            on_illegal=self._journal_illegal,
            calibration_open=lambda: self.runtime is not None and self.runtime.calibration_open,
            table=table,
        )
        self.heartbeat = HeartbeatThread(
            recorder,
            machine=self.machine,
            interval_s=args.heartbeat_interval_s,
            deadline_s=args.state_deadline_s,
            pending=lambda: self.runtime.comm.pending.snapshot() if self.runtime else None,
            groups=lambda: self.runtime.comm.marks() if self.runtime else (),
            collective_stall_s=args.collective_stall_s,
            startup_timeout_s=args.startup_timeout_s,
            on_startup_timeout=self._startup_timed_out,
            on_journal_lost=self.stop_unjournaled,
        )

    # -- journaling hooks ----------------------------------------------------------------------

    def _journal_transition(self, trigger: Trigger, source: State, dest: State) -> None:
        self.recorder.record(
            Transition(trigger=trigger.value, source=source.value, dest=dest.value), state=dest
        )

    def _journal_illegal(self, error: Exception) -> None:
        self.recorder.record(
            error_event(error, fatal=False, trigger=getattr(error, "trigger", None), traceback="")
        )

    def fire(self, trigger: Trigger) -> State:
        with self._fire_lock:
            return self.machine.fire(trigger)

    # -- startup -------------------------------------------------------------------------------

    def start(self) -> None:
        """Journal the rank's start, start its heartbeat, join the process group."""
        device = select_device(
            self.args.device, local_rank=self.launch.rank % self.launch.local_ranks
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.recorder.record(
            run_started(
                self.launch,
                world_size=self.args.num_ranks,
                device=device,
                wall=self.recorder.clock.wall(),
            )
        )
        self.heartbeat.start()
        if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            # The host's cores shared by its ranks, unless the operator said how many.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.launch.local_ranks))
        flight = folder_for(self.args, self.launch.run_id)
        fr_on = self.launch.distributed and turn_on(
            os.environ, entries=self.args.flight_recorder_entries, folder=flight
        )
        if self.launch.distributed:
            self._run_action(
                "init-process-group",
                lambda: join_process_group(
                    device=device,
                    rank=self.launch.rank,
                    world_size=self.args.num_ranks,
                    dist_timeout_s=self.args.dist_timeout_s,
                    env=os.environ,
                ),
            )
            self._run_action("align-clock", lambda: self._align_clock(device))
            self._run_action("agree-settings", self._agree_settings)
            if self.args.on_peer_failure is PeerFailure.ABORT:
                self.peers = watch_peers(
                    os.environ,
                    trust=self.trust,
                    rank=self.launch.rank,
                    world_size=self.args.num_ranks,
                    on_abort=self.abort,
                )
        comm = Comm(
            layout=self.layout,
            sink=self.recorder,
            device=device,
            timeout_s=self.args.dist_timeout_s,
            skip=self.faults.skip_collective,
            distributed=self.launch.distributed,
        )
        if fr_on:  # each trouble the recorder journals dumps the Flight Recorder too
            self.recorder.on_trouble(
                FlightDumper(
                    root=folder_for(self.args),
                    run_id=self.launch.run_id,
                    rank=self.launch.rank,
                    sink=self.recorder,
                    groups=comm.torch_names,
                ).dump
            )
        self.runtime = RankRuntime(
            args=self.args,
            layout=self.layout,
            recorder=self.recorder,
            comm=comm,
            device=device,
            meter=memory_meter(device),
            local_ranks=self.launch.local_ranks,
        )

    def _align_clock(self, device: torch.device) -> None:
        """Measure this rank's clock against rank 0's, journal it, and stamp what follows on
        rank 0's clock, so that "first" means first across hosts."""
        offset, trip = measure_clock_offset(device, self.recorder.clock.wall)
        self.recorder.align_clock(offset)
        self.recorder.record(
            ClockAligned(offset_s=offset, round_trip_s=trip, host=socket.gethostname())
        )

    def _agree_settings(self) -> None:
        """Fail unless every rank was started with the settings the run records (torchrun
        gives each rank its own command line)."""
        launch = self.launch
        self.disagreement = settings_disagreement(
            self.args, rank=launch.rank, trust=self.trust, env=os.environ
        )
        if self.disagreement is not None:
            raise self.disagreement

    def boot(self) -> State:
        """Walk the table to `ready`; on any error journal it and go to `failed`."""
        try:
            self.start()
            runtime = self.runtime
            assert runtime is not None
            while (
                trigger := happy_trigger(
                    self.machine.state,
                    calibration_open=runtime.calibration_open,
                    table=self.machine.table,
                )
            ) is not None:
                state = self.fire(trigger)
                self.faults.inject_on_entering(state)
                for name, action in self.actions.get(state, ()):
                    if action_runs(name, self.args):
                        self._run_action(name, functools.partial(action, runtime))
        except JournalWriteFailed as exc:
            self.stop_unjournaled(exc)
        except Exception as exc:  # every failure of a startup step is journaled, then fails it
            self.fail(exc)
        return self.machine.state

    def _run_action(self, name: str, action: Callable[[], None]) -> None:
        self.recorder.record(ActionStarted(action=name))
        started = time.perf_counter()
        try:
            action()
        except BaseException:
            self.recorder.record(
                ActionFinished(action=name, duration_s=time.perf_counter() - started, ok=False)
            )
            raise
        self.recorder.record(
            ActionFinished(action=name, duration_s=time.perf_counter() - started, ok=True)
        )

    def fail(self, exc: BaseException, *, where: str | None = None) -> None:
        """Journal `exc` as the rank's fatal error, move to `failed`, and announce it to the
        peers (the agreed abort); `where` stands in for the traceback of an error that was not
        raised. An error that follows a peer's announced failure (a collective the failed peer
        left) is that failure's consequence: the rank aborts instead."""
        if isinstance(exc, ConfigError) and self.refused is None:
            self.refused = exc
        peers = self.peers
        earlier = peers.first_failure() if peers is not None else None
        if (
            earlier is not None
            and earlier.rank != self.launch.rank
            # A store gone is news of a peer only for an error a peer's going explains.
            and (earlier.rank is not None or classify(exc) in COLLECTIVE_KINDS)
        ):
            self.abort(earlier)
            return
        state = self.machine.state.value
        try:
            error = fatal_error(
                exc, traceback=(where or "".join(traceback.format_exception(exc)))[-8000:]
            )
            self.recorder.record(error)
            with self._fire_lock:
                if self.machine.state not in TERMINAL_STATES:
                    self.fire(Trigger.FAIL)
        except JournalWriteFailed as lost:
            self.stop_unjournaled(lost)
        except JournalError:
            pass  # another writer holds this rank's sequence: nothing more can be recorded
        if peers is not None:
            peers.announce(
                failure_of(exc, rank=self.launch.rank, state=state, kind=classify(exc).value)
            )

    def abort(self, failure: Failure) -> None:
        """A peer failed for good: journal why this rank stops (`aborted`, naming the peer and
        its error), write what it keeps for trouble (its collective ring, the Flight Recorder),
        and leave (exit 1), never waiting in a collective after the decision. A rank already
        failed or stopped keeps its own end. A failure naming this rank is this rank taken for
        lost (its beats stopped: the process was stopped or starved): it fails on that."""
        with self._fire_lock:
            if self.machine.state in TERMINAL_STATES:
                return
            if failure.rank == self.launch.rank:
                taken = f"taken for lost by the group: {failure.message}"
                self.fail(RankLost(taken, rank=failure.rank), where=failure.message)
            else:
                self._journal_abort(failure)
        self.close()
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        self._leave(Exit.FAILED)

    def _journal_abort(self, failure: Failure) -> None:
        try:
            self.recorder.record(
                Aborted(
                    failed_rank=failure.rank,
                    error_type=failure.error_type,
                    error_kind=failure.error_kind,
                    message=failure.message,
                    failed_state=failure.state,
                    announced_by=failure.announced_by,
                    learned_after_s=max(0.0, time.time() - failure.wall),
                )
            )
            self.fire(Trigger.FAIL)
        except JournalWriteFailed as lost:
            self.stop_unjournaled(lost)
        except JournalError:
            pass

    def stop_unjournaled(self, exc: JournalWriteFailed) -> None:
        """The journal cannot be written: say so in one line and leave with exit status 3,
        from whichever thread found out first."""
        with self._leaving:
            who = f"rank {self.launch.rank}: " if self.launch.distributed else ""
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                # One write: the ranks of a launcher share its stderr.
                sys.stderr.write(f"lifecycle: error: {who}{exc}\n")
                sys.stderr.flush()
            self._leave(Exit.UNJOURNALED)

    def _startup_timed_out(self, waited_s: float) -> None:
        """Called by the heartbeat thread: the main thread may be stuck for good, so this
        thread journals the timeout, fails the rank, and ends the process."""
        with self._fire_lock:
            if self.machine.state in (State.READY, *TERMINAL_STATES):
                return
            error = StartupTimeout(
                timeout_s=self.args.startup_timeout_s, state=self.machine.state.value
            )
            main = sys._current_frames().get(threading.main_thread().ident or -1)
            stuck = "".join(traceback.format_stack(main)) if main is not None else None
            self.fail(
                error, where=f"main thread after {waited_s:.1f} s:\n{stuck}" if stuck else None
            )
        self.close()
        self._leave(Exit.FAILED)

    # -- after ready ---------------------------------------------------------------------------

    def serve_collectives_from_ring(self) -> None:
        """After ready, keep collective records in the recorder's ring: the journal gets them
        only on trouble, and each request's summary and each heartbeat say how far every
        group got."""
        self.recorder.keep_collectives_in_ring(self.args.ring_capacity)

    def dump_ring(self, reason: str) -> None:
        """Write the collective ring to the journal now (SIGUSR1, `POST /debug/dump`)."""
        try:
            self.recorder.dump(reason)
        except JournalWriteFailed as exc:
            self.stop_unjournaled(exc)
        except JournalError:
            pass  # the writer is closed: the rank is shutting down

    def stop(self, *, reason: str, signal_name: str | None = None) -> None:
        """Journal a shutdown; a ready rank moves to `stopped`."""
        with self._fire_lock:
            try:
                written, write_s = self.recorder.journal_cost()
                self.recorder.record(
                    Shutdown(
                        reason=reason,
                        signal=signal_name,
                        events_written=written,
                        journal_write_s=write_s,
                    )
                )
                if self.machine.state is State.READY:
                    self.fire(Trigger.STOP)
            except JournalWriteFailed as exc:
                self.stop_unjournaled(exc)

    def shutdown_before_start(self, sig: signal.Signals) -> int:
        """A signal that came while the rank was starting (its imports, its journal being
        opened): journal its start and then its stop, and the exit status to leave with."""
        device = select_device(
            self.args.device, local_rank=self.launch.rank % self.launch.local_ranks
        )
        self.recorder.record(
            run_started(
                self.launch,
                world_size=self.args.num_ranks,
                device=device,
                wall=self.recorder.clock.wall(),
            )
        )
        return self.shutdown_by_signal(sig)

    def shutdown_by_signal(self, sig: signal.Signals) -> int:
        """Journal a shutdown by `sig` and close; the exit status to leave with.

        A rank that had already stopped cleanly was only hurried out of its teardown: it
        records nothing more and leaves with 0.
        """
        with self._fire_lock:
            if self.machine.state is State.STOPPED:
                return 0
            self.stop(reason="signal", signal_name=sig.name)
        self.close()
        return SIGNAL_EXIT_BASE + int(sig)

    def linger(self, seconds: float, *, until: threading.Event) -> None:
        """Stay alive (heartbeating) after a failure so that peers block as they would under
        NCCL, until `until` is set or `seconds` pass."""
        until.wait(timeout=seconds)

    def close(self) -> None:
        if self.peers is not None:
            self.peers.stop()
        self.heartbeat.stop()
        try:
            self.recorder.close()
        except JournalWriteFailed as exc:  # collective records still in the ring were lost
            self.stop_unjournaled(exc)
        except JournalError:
            pass
