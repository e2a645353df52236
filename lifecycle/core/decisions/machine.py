"""The startup machine: the `transitions` library driven by the table, with write-ahead hooks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from transitions import EventData, Machine, MachineError

from lifecycle.core.errors import IllegalTransition
from lifecycle.core.format.states import TRANSITIONS, Edge, Guard, State, Trigger, guard_holds

# Called with (trigger, source, dest) after the conditions pass and before the state changes.
# Whatever it raises aborts the transition, so a transition that could not be journaled is
# never taken.
BeforeHook = Callable[[Trigger, State, State], None]
# Called with the rejected trigger's error; the state has not changed.
IllegalHook = Callable[[IllegalTransition], None]


class _Model:
    """The object `transitions` drives; it holds nothing but the current state."""

    state: str


class LifecycleMachine:
    """Moves one rank through the transition table; nothing else holds its state."""

    def __init__(
        self,
        *,
        before: BeforeHook,
        on_illegal: IllegalHook,
        calibration_open: Callable[[], bool],
        table: tuple[Edge, ...] = TRANSITIONS,
        initial: State | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self._before = before
        self._on_illegal = on_illegal
        self._calibration_open = calibration_open
        self._clock_ns = clock_ns
        self.table = table
        self._states = {e.source.value: e.source for e in table} | {
            e.dest.value: e.dest for e in table
        }
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=list(self._states),
            initial=(initial or table[0].source).value,
            transitions=[self._edge_spec(e.trigger, e.source, e.dest, e.guard) for e in table],
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=False,
            after_state_change=[self._entered],
        )
        self.entered_mono_ns = clock_ns()

    def _entered(self, event: EventData) -> None:
        self.entered_mono_ns = self._clock_ns()

    def in_state_s(self) -> float:
        """How long the machine has been in its current state."""
        return (self._clock_ns() - self.entered_mono_ns) / 1e9

    def _edge_spec(
        self, trigger: Trigger, source: State, dest: State, guard: Guard | None
    ) -> dict[str, Any]:
        def before(event: EventData) -> None:
            self._before(trigger, source, dest)

        spec: dict[str, Any] = {
            "trigger": trigger.value,
            "source": source.value,
            "dest": dest.value,
            "before": [before],
        }
        if guard is not None:

            def condition(event: EventData) -> bool:
                return guard_holds(guard, calibration_open=self._calibration_open())

            spec["conditions"] = [condition]
        return spec

    @property
    def state(self) -> State:
        """The current state: the machine is the only holder of it."""
        return self._states[self._model.state]

    def fire(self, trigger: Trigger) -> State:
        """Take `trigger`; return the new state, or raise IllegalTransition (state unchanged)."""
        state = self.state
        event = self._machine.events.get(trigger.value)
        if event is None:
            self._reject(state, trigger, f"the table has no {trigger.value!r} trigger")
        try:
            moved = event.trigger(self._model)
        except MachineError:
            self._reject(state, trigger, f"the table has no {trigger.value!r} from {state.value!r}")
        if not moved:
            reason = (
                "the calibration gate is closed"
                if self._calibration_open() is False
                else "the calibration gate is open"
            )
            self._reject(state, trigger, reason)
        return self.state

    def _reject(self, state: State, trigger: Trigger, reason: str) -> NoReturn:
        error = IllegalTransition(state=state.value, trigger=trigger.value, reason=reason)
        self._on_illegal(error)
        raise error

    def allowed(self) -> tuple[Trigger, ...]:
        """The triggers that the table allows from here, given the current gate decision."""
        state, open_ = self.state, self._calibration_open()
        return tuple(
            e.trigger
            for e in self.table
            if e.source == state and guard_holds(e.guard, calibration_open=open_)
        )
