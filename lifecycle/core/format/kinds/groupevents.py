"""The process group's events: collectives entered and finished, staging buffers, beats and
stalls, the ring's and the Flight Recorder's dumps, the clock aligned, the agreed abort (part
of the journal's format, as every kind lifecycle.core.format.events lists)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.format.kinds.eventkind import Event
from lifecycle.core.format.records import (
    GroupMark,
    PendingCollective,
    Signature,
    ThreadStack,
    TorchGroup,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveStarted(Event, Signature):
    """A collective a rank entered: its signature (what its peers' must match), and where."""

    kind: ClassVar[str] = "collective_started"
    group: str
    group_ranks: tuple[int, ...]
    group_seq: int
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveFinished(Event):
    kind: ClassVar[str] = "collective_finished"
    group: str
    group_seq: int
    op: str
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BuffersAllocated(Event):
    kind: ClassVar[str] = "buffers_allocated"
    purpose: str
    key: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    live_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BuffersDropped(Event):
    kind: ClassVar[str] = "buffers_dropped"
    buffers: int
    bytes_freed: int
    keys: tuple[str, ...]
    allocator_released_bytes: int | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Event):
    """Version 2 carries every group's progress, so that a rank whose collective records wait
    in its ring (after ready) is still placed when it dies without writing them."""

    kind: ClassVar[str] = "heartbeat"
    version: ClassVar[int] = 2
    uptime_s: float
    in_state_s: float
    pending: PendingCollective | None
    groups: tuple[GroupMark, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Stalled(Event):
    kind: ClassVar[str] = "stalled"
    in_state_s: float
    deadline_s: float
    pending: PendingCollective | None
    threads: tuple[ThreadStack, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectivesDumped(Event):
    """The collective records of the ring after ready follow this event in the journal (their
    own wall times are when they happened); `dropped` records fell out of the bounded ring
    since the last dump."""

    kind: ClassVar[str] = "collectives_dumped"
    reason: str  # error, stall, request-failed, shutdown, signal, http
    records: int
    dropped: int
    capacity: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightRecorderDumped(Event):
    """PyTorch's Flight Recorder dumped on trouble to `path` on `host` (`error`: why not), with
    torch's name for each of the lifecycle's `groups`."""

    kind: ClassVar[str] = "flight_recorder_dumped"
    reason: str  # the trouble: stall, request-failed, signal, an error kind, or an explicit dump
    path: str | None
    host: str
    bytes: int
    entries: int
    groups: tuple[TorchGroup, ...]
    error: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClockAligned(Event):
    """This rank's wall clock measured against rank 0's at the rendezvous: from this event on,
    its events' wall times are on rank 0's clock (local time minus `offset_s`), so ranks on
    different hosts order correctly; events before it keep the local clock."""

    kind: ClassVar[str] = "clock_aligned"
    offset_s: float  # this rank's clock minus rank 0's: 0 where both read one kernel's clock
    round_trip_s: float  # of the exchange the offset was taken from: its uncertainty
    host: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Aborted(Event):
    """This rank stops because a peer failed for good: the run's agreed abort, instead of
    waiting in its next collective until the process-group timeout. It names the peer, its
    error as the peer announced it (or its process's end, as its launcher saw it), the state
    the peer failed in, and how long after the peer's failure this rank learned it."""

    kind: ClassVar[str] = "aborted"
    version: ClassVar[int] = 1
    failed_rank: int | None  # None: the rendezvous store went away, and with it its host
    error_type: str
    error_kind: str
    message: str
    failed_state: str | None
    announced_by: str  # "rank" (the failed rank itself) or "launcher" (its process ended)
    learned_after_s: float
