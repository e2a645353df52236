"""Fault specs (`--fault RANK:STATE:KIND`): what to break on purpose, parsed and checked."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from lifecycle.core.errors import FaultSpecError
from lifecycle.core.states import ACTION_STATES, State


class FaultKind(StrEnum):
    RAISE = "raise"
    HANG = "hang"
    EXIT = "exit"
    SKIP_COLLECTIVE = "skip-collective"


# A fault fires on entering a state that runs actions; anywhere else it would never fire.
FAULTABLE_STATES = ACTION_STATES


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultSpec:
    rank: int
    state: State
    kind: FaultKind

    def __str__(self) -> str:
        return f"{self.rank}:{self.state.value}:{self.kind.value}"


def parse_fault(spec: str) -> FaultSpec:
    """Parse one `RANK:STATE:KIND` spec; raise FaultSpecError with a one-line reason."""
    text = spec.strip()
    parts = text.split(":")
    if len(parts) != 3:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: expected RANK:STATE:KIND, e.g. 1:drop-buffers:raise",
            spec=spec,
        )
    rank_text, state_text, kind_text = (p.strip() for p in parts)
    if not rank_text.isascii() or not rank_text.isdigit():
        raise FaultSpecError(
            f"bad fault spec {spec!r}: rank {rank_text!r} is not a non-negative integer",
            spec=spec,
        )
    faultable = {s.value: s for s in FAULTABLE_STATES}
    if state_text not in faultable:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: state {state_text!r} is not one of " + ", ".join(faultable),
            spec=spec,
        )
    kinds = {k.value: k for k in FaultKind}
    if kind_text not in kinds:
        raise FaultSpecError(
            f"bad fault spec {spec!r}: kind {kind_text!r} is not one of " + ", ".join(kinds),
            spec=spec,
        )
    return FaultSpec(rank=int(rank_text), state=faultable[state_text], kind=kinds[kind_text])


def parse_faults(
    specs: list[str] | tuple[str, ...], env_value: str | None = None
) -> tuple[FaultSpec, ...]:
    """Parse the `--fault` specs and the comma-separated `LIFECYCLE_FAULTS` value, in that order."""
    texts = list(specs)
    if env_value:
        texts.extend(part for part in env_value.split(",") if part.strip())
    return tuple(parse_fault(t) for t in texts)
