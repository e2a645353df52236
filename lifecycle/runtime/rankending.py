"""How a rank's startup or serving ends: failed, aborted for a peer, timed out, its journal
lost, stopped or signalled; each end journaled first when the journal can still be written."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from lifecycle.core.command import SIGNAL_EXIT_BASE, Exit
from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.errors import (
    COLLECTIVE_KINDS,
    ConfigError,
    JournalError,
    JournalWriteFailed,
    RankLost,
    StartupTimeout,
    classify,
)
from lifecycle.core.format.events import Aborted, Shutdown
from lifecycle.core.format.states import SERVING_STATES, TERMINAL_STATES, State, Trigger
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.group.abort import AbortWatcher, Failure, failure_of
from lifecycle.runtime.group.heartbeat import HeartbeatThread
from lifecycle.runtime.group.process_group import fatal_error
from lifecycle.runtime.rankstart import RankLaunch
from lifecycle.runtime.recorder import Recorder


class RankEnding:
    """The ends of a rank's session (`RankSession` in runtime/session.py is one): what each
    journals, which state it moves to, and the exit status the rank leaves with."""

    args: ServerArgs
    launch: RankLaunch
    recorder: Recorder
    machine: LifecycleMachine
    heartbeat: HeartbeatThread
    peers: AbortWatcher | None
    refused: ConfigError | None
    _fire_lock: threading.RLock
    _leaving: threading.Lock
    _leave: Callable[[int], None]

    def fire(self, trigger: Trigger) -> State:
        with self._fire_lock:
            return self.machine.fire(trigger)

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
            if self.machine.state in SERVING_STATES | TERMINAL_STATES:
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
                if self.machine.state in (State.READY, State.ASLEEP):
                    self.fire(Trigger.STOP)
            except JournalWriteFailed as exc:
                self.stop_unjournaled(exc)

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
