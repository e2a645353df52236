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
    # A server put to sleep (POST /sleep): no request admitted, the weights given back to the
    # host's keeper; waking brings them back and verifies them before it is ready again.
    ASLEEP = "asleep"
    WAKING = "waking"
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
    SLEEP = "sleep"
    WAKE = "wake"


class Guard(StrEnum):
    """A condition on an edge; the machine evaluates it against the recorded gate decision."""

    CALIBRATION_OPEN = "calibration-open"
    CALIBRATION_CLOSED = "calibration-closed"


TERMINAL_STATES = frozenset({State.FAILED, State.STOPPED})
# The states of a rank that reached ready and serves (or sleeps): the startup is over.
SERVING_STATES = frozenset({State.READY, State.ASLEEP, State.WAKING})


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
    Edge(trigger=Trigger.SLEEP, source=State.READY, dest=State.ASLEEP),
    Edge(trigger=Trigger.WAKE, source=State.ASLEEP, dest=State.WAKING),
    Edge(trigger=Trigger.FINISH, source=State.WAKING, dest=State.READY),
    Edge(trigger=Trigger.STOP, source=State.ASLEEP, dest=State.STOPPED),
)


# Triggers that leave the happy path: a failure from anywhere, a stop or a sleep (and the wake
# after it) from outside.
OFF_PATH_TRIGGERS = frozenset({Trigger.FAIL, Trigger.STOP, Trigger.SLEEP, Trigger.WAKE})


def edges_from(
    state: State, trigger: Trigger, *, table: tuple[Edge, ...] = TRANSITIONS
) -> tuple[Edge, ...]:
    """The edges a trigger may take from a state, in table order."""
    return tuple(e for e in table if e.source == state and e.trigger == trigger)


def happy_trigger(
    state: State, *, calibration_open: bool, table: tuple[Edge, ...] = TRANSITIONS
) -> Trigger | None:
    """The trigger a healthy startup takes from `state`, read off the table; None where the
    startup has arrived (ready) or ended."""
    for edge in table:
        if (
            edge.source == state
            and edge.trigger not in OFF_PATH_TRIGGERS
            and guard_holds(edge.guard, calibration_open=calibration_open)
        ):
            return edge.trigger
    return None


def action_states(table: tuple[Edge, ...] = TRANSITIONS) -> tuple[State, ...]:
    """The states a startup enters on its way to ready, each of which runs its actions on
    entry: every destination of a happy-path edge, in the order the longest path (calibration
    open) walks them from the table's first source."""
    walked: dict[State, None] = {}
    state = table[0].source
    while (trigger := happy_trigger(state, calibration_open=True, table=table)) is not None:
        dest = next_state(state, trigger, calibration_open=True, table=table)
        if dest is None or dest in walked:
            break
        walked[dest] = None
        state = dest
    for edge in table:
        if edge.trigger not in OFF_PATH_TRIGGERS:
            walked.setdefault(edge.dest, None)
    return tuple(walked)


def guard_holds(guard: Guard | None, *, calibration_open: bool) -> bool:
    if guard is None:
        return True
    if guard is Guard.CALIBRATION_OPEN:
        return calibration_open
    return not calibration_open


def next_state(
    state: State, trigger: Trigger, *, calibration_open: bool, table: tuple[Edge, ...] = TRANSITIONS
) -> State | None:
    """Where the table sends `trigger` from `state`, or None when it is not allowed."""
    for edge in edges_from(state, trigger, table=table):
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


# gate-check, bounded-warm, probe, re-warm, drop-buffers, ready: derived, never listed by hand.
ACTION_STATES = action_states()
