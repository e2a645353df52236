"""Where a rank is now, as the boot console shows it while a state goes on: its state, its
request's step (or the decode after the steps), the action it runs, and what history expects
(pure)."""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.format.records import StateExpectation
from lifecycle.serve.console.steps import StepMark

# What the console says of an action while it runs, for an action that can run long with no
# steps of its own to show: --compile's cold compile of micro-video's blocks took 38 to 47 s
# on CPU, all in the first step of its one-step request.
RUNNING_TEXT = {"compile": "compiling the denoiser's repeated blocks"}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankStatus:
    """Where a rank is now, as a console shows it."""

    rank: int
    state: str
    entered_at: float
    mark: StepMark | None  # its current request's steps, when they are of this state
    expected: StateExpectation | None  # what history expects of this state
    action: str | None = None  # the action it runs now

    def in_state_s(self, now: float) -> float:
        return max(0.0, now - self.entered_at)

    @property
    def running(self) -> str | None:
        """What its action is doing, in words, for an action RUNNING_TEXT names."""
        return RUNNING_TEXT.get(self.action or "")

    @property
    def stepping(self) -> bool:
        """Whether its request is in its denoising steps (not before, nor decoding after)."""
        return self.mark is not None and self.mark.stage is None


def expected_text(expected: StateExpectation | None) -> str:
    if expected is None:
        return ""
    return f"expected {expected.median_s:.1f} s, p95 {expected.p95_s:.1f} s"


def request_text(mark: StepMark) -> str:
    """How far a request has got: its step, or the stage after its steps (its decode)."""
    step = f"step {mark.done}/{mark.steps}"
    return step if mark.stage is None else f"{mark.stage} after {step}"


def doing_text(status: RankStatus) -> str:
    """What a rank's state is doing now, as its bar says it: the action running, its
    request's step or decode; empty where nothing says."""
    parts = [status.running, None if status.mark is None else request_text(status.mark)]
    return ", ".join(part for part in parts if part)


def step_line(status: RankStatus, *, now: float) -> str:
    """A state that goes on, in a line: what it runs, its request's steps (or the decode after
    them) so far, and what it is expected to take."""
    line = f"  {status.state:<13} {status.in_state_s(now):8.1f} s so far"
    if status.running is not None:
        line += f", {status.running}"
    if status.mark is not None:
        line += f", {request_text(status.mark)} of its request"
    if status.expected is not None:
        line += f" ({expected_text(status.expected)})"
    return line
