"""The heartbeat thread journals a state's stall when its deadline passes, not at the next beat
(docs/concepts.md: deadlines learned from history)."""

from __future__ import annotations

import time
from pathlib import Path

from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.format.events import Stalled
from lifecycle.core.format.states import State, Trigger
from lifecycle.runtime.group.heartbeat import HeartbeatThread
from lifecycle.runtime.recorder import Recorder
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow

INTERVAL_S = 60.0  # no beat comes during the test: a stall can only come from the deadline
DEADLINE_S = 0.3
WAIT_S = 20.0


def _no_pending() -> None:
    return None


def _ignore(*_args: object) -> None:
    return None


def test_a_stall_is_journaled_at_the_deadline_between_two_beats(tmp_path: Path) -> None:
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    journal.create_run(
        RunRow(
            run_id="run-a",
            created_at=time.time(),
            host="h",
            world_size=1,
            config={},
            lifecycle_version="0",
        )
    )
    recorder = Recorder(journal.writer(run_id="run-a", rank=0))
    machine = LifecycleMachine(before=_ignore, on_illegal=_ignore, calibration_open=lambda: False)
    machine.fire(Trigger.START)
    heartbeat = HeartbeatThread(
        recorder, machine=machine, interval_s=INTERVAL_S, deadline_s=DEADLINE_S,
        pending=_no_pending,
    )  # fmt: skip
    entered = time.monotonic()
    heartbeat.start()
    try:
        stalls: list[Stalled] = []
        while not stalls and time.monotonic() - entered < WAIT_S:
            time.sleep(0.05)
            stalls = [s.event for s in journal.read(run_id="run-a") if isinstance(s.event, Stalled)]
        seen_after = time.monotonic() - entered
    finally:
        heartbeat.stop()
        journal.close()
    assert stalls, f"no stall within {WAIT_S:g} s, with a deadline of {DEADLINE_S:g} s"
    (stall,) = stalls
    assert machine.state is State.GATE_CHECK
    assert stall.deadline_s == DEADLINE_S and stall.in_state_s > DEADLINE_S
    # Long before the first beat: the thread woke for the deadline.
    assert seen_after < INTERVAL_S / 2


def test_the_thread_reports_its_own_cpu_time_while_it_runs(tmp_path: Path) -> None:
    """`cpu_s` reads the heartbeat thread's own CPU clock: it grows while the thread beats
    (each beat journals an event) and reads 0 once the thread has stopped."""
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    journal.create_run(
        RunRow(run_id="run-b", created_at=time.time(), host="h", world_size=1, config={},
               lifecycle_version="0")
    )  # fmt: skip
    recorder = Recorder(journal.writer(run_id="run-b", rank=0))
    machine = LifecycleMachine(before=_ignore, on_illegal=_ignore, calibration_open=lambda: False)
    machine.fire(Trigger.START)
    heartbeat = HeartbeatThread(
        recorder, machine=machine, interval_s=0.02, deadline_s=3600.0, pending=_no_pending
    )
    assert heartbeat.cpu_s() == 0.0  # not started
    heartbeat.start()
    try:
        readings: list[float] = []
        deadline = time.monotonic() + WAIT_S
        while len({r for r in readings if r > 0}) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            readings.append(heartbeat.cpu_s())
    finally:
        heartbeat.stop()
    beats = len(list(journal.read(run_id="run-b")))
    journal.close()
    assert beats >= 2
    assert readings == sorted(readings) and readings[-1] > 0, readings
    assert heartbeat.cpu_s() == 0.0
