"""Fault specs (`--fault RANK:STATE:KIND`, `RANK:request:KIND[:N]`,
`RANK:request:slow:N:FACTOR`): what to break on purpose, parsed and checked."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lifecycle.core.errors import FaultSpecError
from lifecycle.core.format.states import ACTION_STATES, State


class FaultKind(StrEnum):
    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"
    SKIP_COLLECTIVE = "skip-collective"
    OVER_BUDGET = "over-budget"  # re-warm only: the residency plan's verification measures over
    SLOW = "slow"  # the rank's compute FACTOR times slower from there on


# `RANK:STATE:slow` without a factor.
DEFAULT_SLOW_FACTOR = 3.0
MAX_SLOW_FACTOR = 1000.0


# A fault fires on entering a state that runs actions; anywhere else it would never fire.
FAULTABLE_STATES = ACTION_STATES
# States whose actions run no collective, so that a skip-collective fault there could never
# fire: drop-buffers frees each rank's staging buffers on its own (creating them again, a paired
# collective, is the next request's).
COLLECTIVE_FREE_STATES = (State.DROP_BUFFERS,)
# A fault named for `request` fires half-way through the denoising of the Nth request served
# after ready (the first when N is not given).
REQUEST = "request"


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    rank: int
    state: State
    kind: FaultKind
    request: int | None = None  # N for a fault in the Nth request after ready (state: ready)
    factor: float = DEFAULT_SLOW_FACTOR  # how much slower a `slow` fault makes the compute

    def __str__(self) -> str:
        if self.request is None:
            slower = (
                f":{self.factor:g}"
                if self.kind is FaultKind.SLOW and self.factor != DEFAULT_SLOW_FACTOR
                else ""
            )
            return f"{self.rank}:{self.state.value}:{self.kind.value}{slower}"
        slower = (
            f":{self.request}:{self.factor:g}"
            if self.kind is FaultKind.SLOW and self.factor != DEFAULT_SLOW_FACTOR
            else ""
        )
        nth = slower or ("" if self.request == 1 else f":{self.request}")
        return f"{self.rank}:{REQUEST}:{self.kind.value}{nth}"

    @property
    def where(self) -> str:
        """Where it fires, as messages say it: a state, or `request N`."""
        return self.state.value if self.request is None else f"{REQUEST} {self.request}"


def parse_fault(spec: str) -> FaultSpec:
    """Parse one `RANK:STATE:KIND` spec; raise FaultSpecError with a one-line reason."""
    text = spec.strip()
    parts = [p.strip() for p in text.split(":")]
    request: int | None = None
    factor = DEFAULT_SLOW_FACTOR
    if len(parts) == 5 and parts[1] == REQUEST and parts[2] == FaultKind.SLOW.value:
        factor = _slow_factor(spec, parts[4])  # RANK:request:slow:N:FACTOR
        parts = parts[:4]
    if len(parts) == 4 and parts[1] != REQUEST and parts[2] == FaultKind.SLOW.value:
        factor = _slow_factor(spec, parts[3])
        parts = parts[:3]
    if len(parts) in (3, 4) and parts[1] == REQUEST:
        request = _request_number(spec, parts[3] if len(parts) == 4 else "1")
        parts = parts[:3]
    if len(parts) != 3:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: expected RANK:STATE:KIND, RANK:STATE:slow[:FACTOR],"
            " RANK:request:KIND[:N] or RANK:request:slow:N:FACTOR, e.g. 1:drop-buffers:raise",
            spec=spec,
        )
    rank_text, state_text, kind_text = parts
    if not rank_text.isascii() or not rank_text.isdigit():
        raise FaultSpecError(
            f"bad fault spec {spec!r}: rank {rank_text!r} is not a non-negative integer",
            spec=spec,
        )
    faultable = {s.value: s for s in FAULTABLE_STATES}
    if request is None and state_text not in faultable:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: state {state_text!r} is not one of "
            + ", ".join([*faultable, REQUEST]),
            spec=spec,
        )
    kinds = {k.value: k for k in FaultKind}
    if kind_text not in kinds:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: kind {kind_text!r} is not one of " + ", ".join(kinds),
            spec=spec,
        )
    state = State.READY if request is not None else faultable[state_text]
    if kinds[kind_text] is FaultKind.OVER_BUDGET and state is not State.RE_WARM:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: over-budget fires only in re-warm, where the residency"
            " plan is verified",
            spec=spec,
        )
    if kinds[kind_text] is FaultKind.SKIP_COLLECTIVE and state in COLLECTIVE_FREE_STATES:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: skip-collective never fires in {state.value}, which runs"
            " no collective; name a state that does, or request",
            spec=spec,
        )
    return FaultSpec(
        rank=int(rank_text), state=state, kind=kinds[kind_text], request=request, factor=factor
    )


def _slow_factor(spec: str, text: str) -> float:
    try:
        factor = float(text)
    except ValueError:
        factor = float("nan")
    if not 1 < factor <= MAX_SLOW_FACTOR:  # NaN fails too
        raise FaultSpecError(
            f"bad fault spec {spec!r}: slow factor {text!r} is not a number in"
            f" (1, {MAX_SLOW_FACTOR:g}]",
            spec=spec,
        )
    return factor


def _request_number(spec: str, text: str) -> int:
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: request number {text!r} is not a positive integer",
            spec=spec,
        )
    return int(text)


def parse_faults(
    specs: list[str] | tuple[str, ...], env_value: str | None = None
) -> tuple[FaultSpec, ...]:
    """Parse the `--fault` specs and the comma-separated `LIFECYCLE_FAULTS` value, in that order."""
    texts = list(specs)
    if env_value:
        texts.extend(part for part in env_value.split(",") if part.strip())
    return tuple(parse_fault(t) for t in texts)
