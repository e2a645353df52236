"""What `lifecycle boot` and `serve` print while a startup runs: one line per state left (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lifecycle.core.events import (
    ActionFinished,
    BuffersDropped,
    Error,
    FaultInjected,
    PlanBuilt,
    ResidencyApplied,
    ResidencyPlanned,
    ResidencyRolledBack,
    ResidencyVerified,
    StoredEvent,
    Transition,
    WarmupRecord,
)
from lifecycle.core.plan import Role
from lifecycle.core.states import State

MIB = 2**20


def format_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / MIB:.1f} MiB"


@dataclass
class ProgressPrinter:
    """Turns the ranks' events into the lines to show: rank 0's states with their durations
    and what each did, every rank's faults, errors and failures, and the startup's ready line
    once every one of the `ranks` is ready (its ready action done), not before: a rank ready
    while another fails is no startup ready."""

    run_created_at: float
    ranks: int = 1
    _entered: dict[int, tuple[str, float]] = field(default_factory=dict)
    _details: dict[int, list[str]] = field(default_factory=dict)
    _warmup_s: dict[int, float] = field(default_factory=dict)
    _ready_at: dict[int, float] = field(default_factory=dict)  # when each rank entered ready
    _ready_done: set[int] = field(default_factory=set)  # ranks whose ready action finished
    _announced: bool = False

    def feed(self, stored: StoredEvent) -> list[str]:
        rank = stored.rank
        prefix = f"[rank {rank}] " if rank else ""
        progress: list[str] = []  # this rank's own progress: shown for rank 0
        out: list[str] = []  # shown for every rank
        event = stored.event
        details = self._details.setdefault(rank, [])
        if rank not in self._entered:
            self._entered[rank] = (State.CREATED.value, stored.wall_time)
        match event:
            case Transition():
                state, since = self._entered[rank]
                # Ready is announced once for the startup; a rank that fails there says so.
                if state != State.READY or event.dest == State.FAILED:
                    line = f"{prefix}  {state:<13} {stored.wall_time - since:8.3f} s"
                    if details:
                        line += "   " + "; ".join(details)
                    progress.append(line)
                details.clear()
                self._entered[rank] = (event.dest, stored.wall_time)
                if event.dest == State.READY:
                    self._ready_at[rank] = stored.wall_time
                elif event.dest == State.FAILED:
                    out.append(f"{prefix}  failed")
            case ActionFinished() if stored.state == State.READY and event.ok:
                self._ready_done.add(rank)
                if len(self._ready_done) == self.ranks and not self._announced:
                    self._announced = True
                    out.append(self._ready_line())
            case PlanBuilt():
                if event.skip_reason is not None:
                    details.append(f"calibration skipped: {event.skip_reason}")
                else:
                    probe = next((r for r in event.requests if r.role is Role.PROBE), None)
                    if probe is not None:
                        details.append(f"calibration on: probe {probe.shape}")
            case WarmupRecord():
                self._warmup_s[rank] = self._warmup_s.get(rank, 0.0) + event.total_s
                details.append(
                    f"{event.role} {event.shape} at {event.steps}"
                    f" steps {event.total_s:.2f} s, peak {format_bytes(event.peak_bytes)}"
                    f" ({event.memory_source or 'unmeasured'})"
                )
            case ResidencyPlanned():
                plan = event.plan
                verdict = "plan" if plan.fits else "no plan applied"
                details.append(
                    f"{verdict} {plan.plan_id}: peak {format_bytes(plan.predicted_peak_bytes)}"
                    f" predicted, budget {format_bytes(plan.budget_bytes)} (not reused:"
                    f" {event.reuse})"
                )
            case ResidencyApplied() if event.reused_from is not None:
                details.append(f"applied {event.plan.plan_id}")
            case ResidencyVerified():
                details.append(
                    f"verified {event.plan.plan_id}: peak {format_bytes(event.measured_bytes)}"
                    f" (predicted {format_bytes(event.predicted_bytes)})"
                )
            case ResidencyRolledBack():
                details.append(f"rolled back {event.plan.plan_id}: {event.reason}")
            case BuffersDropped():
                freed = format_bytes(event.bytes_freed)
                details.append(f"dropped {event.buffers} staging buffers, freed {freed}")
            case FaultInjected():
                out.append(f"{prefix}  fault injected: {event.fault}")
            case Error() if event.fatal:
                out.append(
                    f"{prefix}  error in {stored.state}: {event.error_type}: {event.message}"
                )
            case _:
                pass
        return [*progress, *out] if rank == 0 else out

    def _ready_line(self) -> str:
        """The startup's time to ready (its last rank's) and the longest warmup of a rank."""
        ready_s = max(self._ready_at.values(), default=self.run_created_at) - self.run_created_at
        warm = max(self._warmup_s.values(), default=0.0)
        return f"  {'ready':<13} startup to ready {ready_s:.2f} s (warmup {warm:.2f} s)"
