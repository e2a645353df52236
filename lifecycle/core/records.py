"""Records nested in journal events: part of the journal format (change any of them only with a
version bump of every event kind that holds it, and an upcaster)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from operator import attrgetter
from typing import Any

from lifecycle.core.config import Shape


def shared_fields(source: Any, cls: type) -> dict[str, Any]:
    """The values of `source`'s fields that the dataclass `cls` also has, by name: how a record
    is made from another that carries the same facts, without listing them again."""
    return {f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)}


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchGroup:
    """One of the lifecycle's groups and the name torch (and its Flight Recorder) gives its
    process group ("0" for the default group)."""

    group: str
    torch_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """What one request asks a pipeline for (a warmup's, a smoke request's, a client's)."""

    prompt: str
    negative_prompt: str = ""
    shape: Shape
    steps: int
    guidance_scale: float
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StateExpectation:
    """How long a startup state took in earlier healthy runs, and when it counts as stalled."""

    state: str
    median_s: float
    p95_s: float
    count: int
    deadline_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRecord:
    name: str  # text_encoder, dit, vae
    ran: bool
    seconds: float
    peak_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingCollective:
    group: str
    group_seq: int
    op: str
    purpose: str
    waiting_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupMark:
    """A process group's progress on one rank: the highest group sequence numbers started and
    finished (-1 before the first), and how many collectives it ran."""

    group: str
    ranks: tuple[int, ...]
    started: int
    finished: int
    count: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ThreadStack:
    name: str
    ident: int
    stack: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """What must match across the members of a collective at one sequence number (part of a
    collective's started record)."""

    op: str
    purpose: str
    dtype: str
    shapes: tuple[tuple[int, ...], ...]
    input_splits: tuple[int, ...] | None
    output_splits: tuple[int, ...] | None

    @classmethod
    def of(cls, started: Signature) -> Signature:
        """The signature alone, of a record that carries one (a fold makes one per collective:
        its values are read in one C call)."""
        return cls(**dict(zip(_SIGNATURE_NAMES, _signature_values(started), strict=True)))


_SIGNATURE_NAMES = tuple(f.name for f in fields(Signature))
_signature_values = attrgetter(*_SIGNATURE_NAMES)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestResult:
    """What one request through a pipeline measured: its time per step and per stage, its
    memory, and a checksum of its output (part of a warmup's record)."""

    shape: Shape
    steps: int
    total_s: float
    step_s: tuple[float, ...]
    stages: tuple[StageRecord, ...]
    memory_source: str | None
    baseline_bytes: int | None
    peak_bytes: int | None
    checksum: str
