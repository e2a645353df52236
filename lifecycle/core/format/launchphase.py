"""A rank's launch phase, from run_started version 2: from its launcher's process start
(torchrun's agent's) to its first event, the time before `created` that the field counts in
"startup to healthy", on rank 0's clock (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.format.events import ClockAligned
from lifecycle.core.format.fold import MAX_CLOCK_OFFSET_S
from lifecycle.core.format.view import RankView


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchPhase:
    """A rank's launch, from run_started version 2: from its launcher's process start (torchrun's
    agent's) to its first event, on rank 0's clock (the rank's own clock, aligned at the
    rendezvous as its events are)."""

    launched_at: float
    process_started_at: float | None
    created_at: float  # its first event: `created` begins
    imports_s: float | None  # from its process start to its first event

    @property
    def launch_s(self) -> float:
        return max(0.0, self.created_at - self.launched_at)

    @property
    def spawn_s(self) -> float | None:
        """From the launcher's start to this rank's process start (0 for a rank that is its
        own launcher)."""
        if self.process_started_at is None:
            return None
        return max(0.0, self.process_started_at - self.launched_at)


def launch_phase(view: RankView) -> LaunchPhase | None:
    """The rank's launch phase; None where it was not measured (run_started version 1)."""
    started = view.run_started
    if started is None or started.launcher_started_wall is None or view.first_wall is None:
        return None
    offset = clock_offset(view.clock)
    process = started.process_started_wall
    return LaunchPhase(
        launched_at=started.launcher_started_wall - offset,
        process_started_at=None if process is None else process - offset,
        created_at=view.first_wall,
        imports_s=started.imports_s,
    )


def clock_offset(clock: ClockAligned | None) -> float:
    """What to take from a time on a rank's own clock to put it on rank 0's: as the fold moves
    the events before the alignment (an offset beyond its bound is no offset)."""
    if clock is None or abs(clock.offset_s) > MAX_CLOCK_OFFSET_S:
        return 0.0
    return clock.offset_s
