"""The transition table as data, and its Mermaid rendering."""

from __future__ import annotations

from lifecycle.core.format.states import (
    ACTION_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    State,
    Trigger,
    happy_trigger,
    mermaid,
    next_state,
)


def test_every_non_terminal_state_can_fail() -> None:
    """`fail` leads from every non-terminal state to `failed` and from no terminal one."""
    for state in State:
        dest = next_state(state, Trigger.FAIL, calibration_open=False)
        assert dest == (None if state in TERMINAL_STATES else State.FAILED)


def test_bounded_warm_branches_on_the_calibration_gate() -> None:
    """From bounded-warm, `calibrate` needs the gate open and `finish` needs it closed."""
    assert next_state(State.BOUNDED_WARM, Trigger.CALIBRATE, calibration_open=True) is State.PROBE
    assert next_state(State.BOUNDED_WARM, Trigger.CALIBRATE, calibration_open=False) is None
    assert next_state(State.BOUNDED_WARM, Trigger.FINISH, calibration_open=False) is State.READY
    assert next_state(State.BOUNDED_WARM, Trigger.FINISH, calibration_open=True) is None


def test_the_table_matches_the_design() -> None:
    """The non-fail edges are exactly those of docs/concepts.md's "What a startup is" diagram,
    with its sleep and wake."""
    edges = {
        (e.trigger.value, e.source.value, e.dest.value)
        for e in TRANSITIONS
        if e.trigger is not Trigger.FAIL
    }
    assert edges == {
        ("start", "created", "gate-check"),
        ("warm", "gate-check", "bounded-warm"),
        ("calibrate", "bounded-warm", "probe"),
        ("finish", "bounded-warm", "ready"),
        ("rewarm", "probe", "re-warm"),
        ("drop", "re-warm", "drop-buffers"),
        ("finish", "drop-buffers", "ready"),
        ("stop", "ready", "stopped"),
        ("sleep", "ready", "asleep"),
        ("wake", "asleep", "waking"),
        ("finish", "waking", "ready"),
        ("stop", "asleep", "stopped"),
    }


def test_mermaid_names_every_state_and_edge() -> None:
    """The diagram declares each state by its spelling and draws one line per edge."""
    text = mermaid()
    assert text.startswith("stateDiagram-v2\n")
    for state in State:
        assert f'state "{state.value}"' in text
    assert "bounded_warm --> probe: calibrate [calibration-open]" in text
    assert "bounded_warm --> ready: finish [calibration-closed]" in text
    edge_lines = [line for line in text.splitlines() if "-->" in line and "[*]" not in line]
    assert len(edge_lines) == len(TRANSITIONS)


def test_the_happy_path_is_read_off_the_table() -> None:
    """Walking `happy_trigger` from created reaches ready through exactly the states the
    table lists, with calibration open and closed."""

    def walk(calibration_open: bool) -> list[str]:
        state, path = State.CREATED, [State.CREATED.value]
        while (trigger := happy_trigger(state, calibration_open=calibration_open)) is not None:
            dest = next_state(state, trigger, calibration_open=calibration_open)
            assert dest is not None
            state = dest
            path.append(state.value)
        return path

    assert walk(True) == [
        "created", "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"
    ]  # fmt: skip
    assert walk(False) == ["created", "gate-check", "bounded-warm", "ready"]


def test_action_states_are_every_state_on_the_way_to_ready() -> None:
    """The states that run actions are derived from the table: every happy-path destination,
    in walking order, and neither the initial nor a terminal state."""
    assert [s.value for s in ACTION_STATES] == [
        "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"
    ]  # fmt: skip
    assert not set(ACTION_STATES) & (TERMINAL_STATES | {State.CREATED})
