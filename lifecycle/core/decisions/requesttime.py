"""How long a request is expected to take, from the requests this run measured (its warmups and
the requests it served), and the deadline it is held to past that (pure)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.decisions.residencyplanner import TIME_SLACK, TIME_SLACK_S
from lifecycle.core.errors import ErrorKind, LifecycleError
from lifecycle.core.format.records import RequestResult

# deadline = DEADLINE_MARGIN x predicted + DEADLINE_SLACK_S: the residency planner's allowance
# for a request's time (lifecycle.core.decisions.residencyplanner), from the same evidence: on
# a shared machine a request's time varies by more than its memory does (two boots at once on
# two cores doubled it; a sub-second request beside three busy workers took more than three
# times its prediction plus two seconds). The slack is also the floor: no request is cut short
# within 5 s.
DEADLINE_MARGIN = TIME_SLACK
DEADLINE_SLACK_S = TIME_SLACK_S
# The newest measurements of one shape that its prediction reads: recent enough to follow a
# machine that got slower, enough that one fast request does not set the bar.
RECENT = 8
# --request-timeout's default: no request runs longer, and one predicted to take longer is
# refused before it reaches the ranks (a video of a large model on one GPU takes tens of minutes).
DEFAULT_REQUEST_TIMEOUT_S = 3600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    """What one measured request (a warmup or a served request, on one rank) says of time."""

    tokens: int  # latent tokens of its shape (one branch, every rank's together)
    pixels: int
    step_s: float  # its median denoising step
    other_s: float  # the rest: the text encoder, the decoder, the request's own overhead


def timing_of(result: RequestResult, *, tokens: int) -> Timing | None:
    """A measured request's timing; None when it made no denoising step."""
    if not result.step_s:
        return None
    return Timing(
        tokens=tokens,
        pixels=result.shape.pixels,
        step_s=statistics.median(result.step_s),
        other_s=max(0.0, result.total_s - sum(result.step_s)),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """A request's predicted time, what it was predicted from, and its deadline."""

    seconds: float
    step_s: float  # one denoising step's share of it
    basis: str  # which measurements, in words

    @property
    def deadline_s(self) -> float:
        return DEADLINE_MARGIN * self.seconds + DEADLINE_SLACK_S

    @property
    def stop_s(self) -> float:
        """How long a rank may take to reach the step every rank stops after, once cancelled:
        its step's allowance, as its deadline allows for the whole request."""
        return DEADLINE_MARGIN * self.step_s + DEADLINE_SLACK_S

    def rule(self) -> str:
        """The deadline as the answer to a request past it says it."""
        return (
            f"{self.deadline_s:.1f} s ({DEADLINE_MARGIN:g} x the predicted {self.seconds:.2f} s"
            f" + {DEADLINE_SLACK_S:g} s; predicted from {self.basis})"
        )


def predict(
    timings: Iterable[Timing], *, tokens: int, pixels: int, steps: int
) -> Prediction | None:
    """A request's time at a shape (`tokens`, `pixels`) and `steps`, from `timings` (oldest
    first); None when nothing was measured.

    The same shape measured: its slowest recent step and rest. Else the smallest larger shape
    measured, as it is (a smaller request takes no longer). Else the largest shape measured,
    its step scaled by the square of the tokens' ratio (a step's cost grows at most so: its
    attention) and its rest by the pixels' ratio (the decoder's work)."""
    measured = list(timings)
    if not measured:
        return None
    same = [t for t in measured if t.tokens == tokens and t.pixels == pixels][-RECENT:]
    if same:
        return _prediction(same, steps=steps, step_scale=1.0, other_scale=1.0, basis="this shape")
    larger = [t for t in measured if t.tokens >= tokens and t.pixels >= pixels]
    if larger:
        nearest = min(larger, key=lambda t: (t.tokens, t.pixels))
        basis = f"a larger shape measured ({nearest.tokens} tokens)"
        return _prediction([nearest], steps=steps, step_scale=1.0, other_scale=1.0, basis=basis)
    largest = max(measured, key=lambda t: (t.tokens, t.pixels))
    ratio = tokens / max(1, largest.tokens)
    return _prediction(
        [largest],
        steps=steps,
        step_scale=max(1.0, ratio) ** 2,
        other_scale=max(1.0, pixels / max(1, largest.pixels)),
        basis=f"the largest shape measured ({largest.tokens} tokens), scaled up",
    )


def _prediction(
    timings: Sequence[Timing], *, steps: int, step_scale: float, other_scale: float, basis: str
) -> Prediction:
    step_s = max(t.step_s for t in timings) * step_scale
    other_s = max(t.other_s for t in timings) * other_scale
    return Prediction(seconds=steps * step_s + other_s, step_s=step_s, basis=basis)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeBound:
    """How long a request may run: its prediction's deadline, no longer than the operator's
    limit (--request-timeout); the limit alone when nothing was measured to predict from."""

    seconds: float
    limit_s: float
    prediction: Prediction | None

    @classmethod
    def of(cls, prediction: Prediction | None, *, limit_s: float) -> TimeBound:
        if prediction is None:
            return cls(seconds=limit_s, limit_s=limit_s, prediction=None)
        return cls(
            seconds=min(prediction.deadline_s, limit_s), limit_s=limit_s, prediction=prediction
        )

    def rule(self) -> str:
        """The bound as the answer to a request past it says it."""
        limit = f"--request-timeout {self.limit_s:g} s"
        if self.prediction is None:
            return f"{self.seconds:.1f} s ({limit}; nothing measured to predict from)"
        if self.seconds >= self.limit_s:
            return f"{self.seconds:.1f} s ({limit}; {self.prediction.rule()} is longer)"
        return self.prediction.rule()

    def stop_s(self, silence_s: float) -> float:
        """How long the ranks get to stop once cancelled, before the request is taken for
        stalled: a predicted step's allowance, else their silence bound."""
        return silence_s if self.prediction is None else self.prediction.stop_s


def over_limit(prediction: Prediction | None, *, limit_s: float) -> str | None:
    """Why a request is refused before it reaches the ranks: its predicted time is over the
    operator's limit (--request-timeout); None when it is within it, or nothing predicts it."""
    if prediction is None or prediction.seconds <= limit_s:
        return None
    return (
        f"refused: predicted to take {prediction.seconds:,.1f} s (from {prediction.basis}),"
        f" over --request-timeout {limit_s:g} s"
    )


class RequestCancelled(LifecycleError):
    """A request stopped between denoising steps, after the same step on every rank, because
    the server cancelled it (`reason`: past its deadline)."""

    error_kind: ClassVar[ErrorKind] = ErrorKind.REQUEST_ABORTED

    def __init__(self, *, request_id: str, step: int, steps: int, reason: str) -> None:
        super().__init__(
            f"request {request_id} cancelled after step {step + 1} of {steps}: {reason}"
        )
        self.request_id = request_id
        self.step = step  # the last step made (from 0)
        self.steps = steps
        self.reason = reason
