"""Fault injection on one rank: the faults `--fault` and LIFECYCLE_FAULTS name for it, fired
where they name (entering a state, half-way through the Nth request, a collective skipped,
the rank's compute slowed from there on)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from lifecycle.core.errors import InjectedFault
from lifecycle.core.format.events import FaultInjected
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs, fault_for, request_fault_for
from lifecycle.core.settings.faults import FaultKind, FaultSpec
from lifecycle.runtime.group.slowdown import Slowdown
from lifecycle.runtime.recorder import Recorder

if TYPE_CHECKING:
    from lifecycle.runtime.rankruntime import RankRuntime

FAULT_EXIT_CODE = 17


@dataclass(slots=True)
class RankFaults:
    """The faults one rank injects, each journaled (`fault_injected`) as it fires: those named
    in `args` for this `rank`, in the state `state_of` says, through `runtime_of`'s groups."""

    args: ServerArgs
    _: KW_ONLY
    rank: int
    recorder: Recorder
    state_of: Callable[[], State]
    runtime_of: Callable[[], RankRuntime | None]
    skip_armed: FaultSpec | None = field(default=None, init=False)
    slowdown: Slowdown = field(default_factory=Slowdown, init=False)

    def inject_on_entering(self, state: State) -> None:
        """Fire the fault named for entering `state`, if any."""
        spec = fault_for(self.args, rank=self.rank, state=state)
        if spec is not None:
            self._fire(spec)

    def inject_in_request(self, request: int) -> None:
        """Fire the fault named for the `request`th request after ready, if any: called
        half-way through that request's denoising."""
        spec = request_fault_for(self.args, rank=self.rank, request=request)
        if spec is not None:
            self._fire(spec)

    def _fire(self, spec: FaultSpec) -> None:
        kind = spec.kind
        if kind is FaultKind.SKIP_COLLECTIVE:
            self.skip_armed = spec  # journaled when it fires, with the collective it skipped
            return
        self.recorder.record(FaultInjected(fault=str(spec), fault_kind=kind.value))
        runtime = self.runtime_of()
        if kind is FaultKind.OVER_BUDGET and runtime is not None:
            runtime.over_budget_fault = True  # the residency verification reads it
        if kind is FaultKind.SLOW:
            self.slowdown.start(spec.factor)
        if kind is FaultKind.RAISE:
            raise InjectedFault(rank=self.rank, state=spec.where)
        if kind is FaultKind.EXIT:
            os._exit(FAULT_EXIT_CODE)  # no cleanup, as a crash
        if kind is FaultKind.HANG:
            threading.Event().wait()  # forever; the heartbeat thread goes on

    def skip_collective(self, group: str, group_seq: int, op: str) -> bool:
        """Whether to skip this collective (an armed skip-collective fault in this state);
        asked before each, it first stretches a slowed rank's compute since its last one."""
        if self.slowdown.factor > 1.0:
            runtime = self.runtime_of()
            self.slowdown.stretch(runtime.comm.pending.left_at if runtime is not None else None)
        spec = self.skip_armed
        if spec is None or self.state_of() != spec.state:
            return False
        self.skip_armed = None
        self.recorder.record(
            FaultInjected(
                fault=f"{spec} ({op} #{group_seq} in {group})", fault_kind=spec.kind.value
            )
        )
        return True
