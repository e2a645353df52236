"""The transitions-built machine: legal triggers move per the table, illegal ones change nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.decisions.machine import LifecycleMachine
from lifecycle.core.errors import IllegalTransition
from lifecycle.core.format.states import State, Trigger, next_state


class Log:
    def __init__(self) -> None:
        self.before: list[tuple[Trigger, State, State]] = []
        self.illegal: list[IllegalTransition] = []

    def on_before(self, trigger: Trigger, source: State, dest: State) -> None:
        self.before.append((trigger, source, dest))

    def on_illegal(self, error: IllegalTransition) -> None:
        self.illegal.append(error)


def machine_at(state: State, *, calibration_open: bool, log: Log) -> LifecycleMachine:
    return LifecycleMachine(
        before=log.on_before,
        on_illegal=log.on_illegal,
        calibration_open=lambda: calibration_open,
        initial=state,
    )


@pytest.mark.parametrize("calibration_open", [False, True])
@pytest.mark.parametrize("trigger", list(Trigger))
@pytest.mark.parametrize("state", list(State))
def test_every_state_and_trigger_pair(
    state: State, trigger: Trigger, calibration_open: bool
) -> None:
    """A legal pair moves to the table's destination after the before hook; an illegal one
    raises IllegalTransition, is reported, and leaves the state as it was."""
    log = Log()
    machine = machine_at(state, calibration_open=calibration_open, log=log)
    expected = next_state(state, trigger, calibration_open=calibration_open)
    if expected is None:
        with pytest.raises(IllegalTransition) as info:
            machine.fire(trigger)
        assert machine.state is state
        assert log.before == []
        assert [(e.state, e.trigger) for e in log.illegal] == [(state.value, trigger.value)]
        assert info.value.reason
    else:
        assert machine.fire(trigger) is expected
        assert machine.state is expected
        assert log.before == [(trigger, state, expected)]
        assert log.illegal == []


def test_a_failing_before_hook_leaves_the_state_unchanged() -> None:
    """When the write-ahead hook raises (the journal is gone), the transition is not taken."""

    def refuse(trigger: Trigger, source: State, dest: State) -> None:
        raise OSError("disk full")

    machine = LifecycleMachine(
        before=refuse, on_illegal=lambda e: None, calibration_open=lambda: False
    )
    with pytest.raises(OSError, match="disk full"):
        machine.fire(Trigger.START)
    assert machine.state is State.CREATED


@given(
    triggers=st.lists(st.sampled_from(list(Trigger)), max_size=30),
    calibration_open=st.booleans(),
)
def test_random_trigger_sequences_follow_the_table_or_are_rejected(
    triggers: list[Trigger], calibration_open: bool
) -> None:
    """Any sequence of triggers either follows the table step by step or is rejected."""
    log = Log()
    machine = machine_at(State.CREATED, calibration_open=calibration_open, log=log)
    state = State.CREATED
    for trigger in triggers:
        expected = next_state(state, trigger, calibration_open=calibration_open)
        if expected is None:
            with pytest.raises(IllegalTransition):
                machine.fire(trigger)
        else:
            machine.fire(trigger)
            state = expected
        assert machine.state is state
    assert len(log.before) + len(log.illegal) == len(triggers)


def test_allowed_lists_the_legal_triggers() -> None:
    """allowed() names exactly the triggers the table accepts from here."""
    log = Log()
    machine = machine_at(State.BOUNDED_WARM, calibration_open=True, log=log)
    assert set(machine.allowed()) == {Trigger.CALIBRATE, Trigger.FAIL}
