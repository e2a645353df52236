"""The transition table as data, and its Mermaid rendering."""

from __future__ import annotations

from lifecycle.states import TERMINAL_STATES, TRANSITIONS, State, Trigger, mermaid, next_state


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
    """The non-fail edges are exactly those of DESIGN.md section 3."""
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
