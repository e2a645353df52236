"""The startup states and the transition table, as data."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    CREATED = "created"
    GATE_CHECK = "gate-check"
    BOUNDED_WARM = "bounded-warm"
    PROBE = "probe"
    RE_WARM = "re-warm"
    DROP_BUFFERS = "drop-buffers"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class Trigger(StrEnum):
    START = "start"
    WARM = "warm"
    CALIBRATE = "calibrate"
    FINISH = "finish"
    REWARM = "rewarm"
    DROP = "drop"
    FAIL = "fail"
    STOP = "stop"


class Guard(StrEnum):
    """A condition on an edge; the machine evaluates it against the recorded gate decision."""

    CALIBRATION_OPEN = "calibration-open"
    CALIBRATION_CLOSED = "calibration-closed"


TERMINAL_STATES = frozenset({State.FAILED, State.STOPPED})

# The calibration path, in the order a calibrated startup walks it.
CALIBRATION_STATES = (State.PROBE, State.RE_WARM, State.DROP_BUFFERS)


@dataclass(frozen=True, slots=True, kw_only=True)
class Edge:
    trigger: Trigger
    source: State
    dest: State
    guard: Guard | None = None


TRANSITIONS: tuple[Edge, ...] = (
    Edge(trigger=Trigger.START, source=State.CREATED, dest=State.GATE_CHECK),
    Edge(trigger=Trigger.WARM, source=State.GATE_CHECK, dest=State.BOUNDED_WARM),
    Edge(
        trigger=Trigger.CALIBRATE,
        source=State.BOUNDED_WARM,
        dest=State.PROBE,
        guard=Guard.CALIBRATION_OPEN,
    ),
    Edge(
        trigger=Trigger.FINISH,
        source=State.BOUNDED_WARM,
        dest=State.READY,
        guard=Guard.CALIBRATION_CLOSED,
    ),
    Edge(trigger=Trigger.REWARM, source=State.PROBE, dest=State.RE_WARM),
    Edge(trigger=Trigger.DROP, source=State.RE_WARM, dest=State.DROP_BUFFERS),
    Edge(trigger=Trigger.FINISH, source=State.DROP_BUFFERS, dest=State.READY),
    *(
        Edge(trigger=Trigger.FAIL, source=state, dest=State.FAILED)
        for state in State
        if state not in TERMINAL_STATES
    ),
    Edge(trigger=Trigger.STOP, source=State.READY, dest=State.STOPPED),
)


def edges_from(state: State, trigger: Trigger) -> tuple[Edge, ...]:
    """The edges a trigger may take from a state, in table order."""
    return tuple(e for e in TRANSITIONS if e.source is state and e.trigger is trigger)


def guard_holds(guard: Guard | None, *, calibration_open: bool) -> bool:
    if guard is None:
        return True
    if guard is Guard.CALIBRATION_OPEN:
        return calibration_open
    return not calibration_open


def next_state(state: State, trigger: Trigger, *, calibration_open: bool) -> State | None:
    """Where the table sends `trigger` from `state`, or None when it is not allowed."""
    for edge in edges_from(state, trigger):
        if guard_holds(edge.guard, calibration_open=calibration_open):
            return edge.dest
    return None


def mermaid() -> str:
    """The transition table as a Mermaid state diagram."""

    def node(state: State) -> str:
        return state.value.replace("-", "_")

    lines = ["stateDiagram-v2"]
    lines.extend(f'    state "{s.value}" as {node(s)}' for s in State)
    lines.append(f"    [*] --> {node(State.CREATED)}")
    for edge in TRANSITIONS:
        label = edge.trigger.value + (f" [{edge.guard.value}]" if edge.guard else "")
        lines.append(f"    {node(edge.source)} --> {node(edge.dest)}: {label}")
    lines.extend(f"    {node(s)} --> [*]" for s in (State.FAILED, State.STOPPED))
    return "\n".join(lines) + "\n"
