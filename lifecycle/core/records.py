"""Records nested in journal events: part of the journal format (change any of them only with a
version bump of every event kind that holds it, and an upcaster)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchGroup:
    """One of the lifecycle's groups and the name torch (and its Flight Recorder) gives its
    process group ("0" for the default group)."""

    group: str
    torch_name: str


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
