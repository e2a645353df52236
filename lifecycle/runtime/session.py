"""One rank's startup: the machine driven through its states, every step journaled first."""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping

import torch

from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.errors import (
    ConfigError,
    JournalError,
    JournalWriteFailed,
    RankDisagreement,
)
from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    ClockAligned,
    Transition,
    error_event,
)
from lifecycle.core.format.states import (
    TRANSITIONS,
    Edge,
    State,
    Trigger,
    happy_trigger,
)
from lifecycle.core.settings.config import PeerFailure, RankLayout, ServerArgs
from lifecycle.runtime.actions import STARTUP_ACTIONS, Action, action_runs
from lifecycle.runtime.device import memory_meter, select_device
from lifecycle.runtime.group.abort import AbortWatcher, watch_peers
from lifecycle.runtime.group.clocksync import measure_clock_offset
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.group.flightrecorder import FlightDumper, folder_for, turn_on
from lifecycle.runtime.group.gatecheck import nccl_diagnostics_env
from lifecycle.runtime.group.heartbeat import HeartbeatThread
from lifecycle.runtime.group.process_group import (
    join_process_group,
    settings_disagreement,
)
from lifecycle.runtime.group.signals import leave_process
from lifecycle.runtime.group.storetrust import Rejections, RunKey, StoreTrust
from lifecycle.runtime.injection import RankFaults
from lifecycle.runtime.rankending import RankEnding
from lifecycle.runtime.rankruntime import RankRuntime

# RankLaunch is re-exported: the launcher and the tests make a rank's session from here.
from lifecycle.runtime.rankstart import RankLaunch as RankLaunch  # noqa: PLC0414
from lifecycle.runtime.rankstart import run_started
from lifecycle.runtime.recorder import Recorder


class RankSession(RankEnding):
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

    # -- startup -------------------------------------------------------------------------------

    def start(self) -> None:
        """Journal the rank's start, start its heartbeat, join the process group."""
        device = select_device(
            self.args.device, local_rank=self.launch.rank % self.launch.local_ranks
        )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._journal_start(device)
        self.heartbeat.start()
        if device.type == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
            # The host's cores shared by its ranks, unless the operator said how many.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.launch.local_ranks))
        flight = folder_for(self.args, self.launch.run_id)
        fr_on = self.launch.distributed and turn_on(
            os.environ, entries=self.args.flight_recorder_entries, folder=flight
        )
        if self.launch.distributed and device.type == "cuda" and self.args.nccl_diagnostics:
            # Before the communicators are made: NCCL reads them as it makes each.
            flight.mkdir(parents=True, exist_ok=True)
            os.environ.update(nccl_diagnostics_env(self.args, folder=flight, rank=self.launch.rank))
        if self.launch.distributed:
            self._join_group(device)
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
            slowdown=self.faults.slowdown,
        )

    def _journal_start(self, device: torch.device) -> None:
        self.recorder.record(
            run_started(
                self.launch,
                world_size=self.args.num_ranks,
                device=device,
                wall=self.recorder.clock.wall(),
            )
        )

    def _join_group(self, device: torch.device) -> None:
        """Join the process group, align the clock on rank 0's and agree the settings, each a
        journaled action; watch the peers for the agreed abort when it is on."""
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

    def _align_clock(self, device: torch.device) -> None:
        """Measure this rank's clock against rank 0's (none to measure where both read one
        kernel's), journal it, and stamp what follows on rank 0's clock, so that "first"
        means first across hosts."""
        clock = self.recorder.clock
        offset, trip = measure_clock_offset(device, clock.wall, clock.source())
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

    def act(self, name: str, action: Callable[[], None]) -> None:
        """Run `action` as a journaled action of the current state (a sleep's, a wake's)."""
        self._run_action(name, action)

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

    def shutdown_before_start(self, sig: signal.Signals) -> int:
        """A signal that came while the rank was starting (its imports, its journal being
        opened): journal its start and then its stop, and the exit status to leave with."""
        device = select_device(
            self.args.device, local_rank=self.launch.rank % self.launch.local_ranks
        )
        self._journal_start(device)
        return self.shutdown_by_signal(sig)
