"""The messages between `lifecycle serve` and its rank processes, as the control channel
(lifecycle.serve.ranks.control) and the store's lines across nodes carry them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.records import Generation, StageRecord


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    """A rank process connected; the first message on its link."""

    rank: int
    host: str = ""  # its host's name (under torchrun, where ranks may be on several)


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    """The rank finished its startup and serves requests."""

    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate:
    """Run one request; every rank gets the same one, under the server's request id."""

    request_id: str
    request: Generation
    return_video: bool = False  # the rank that decodes sends the video with its result
    # The server's span of the request (W3C traceparent): each rank's span of it is its child.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """A rank finished a denoising step of a request: it is alive and working on it."""

    request_id: str
    rank: int
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """A rank's answer to a request: its timing and checksum, or why it failed."""

    request_id: str
    rank: int
    ok: bool
    error: str | None = None
    error_kind: str | None = None  # the ErrorKind of `error`: a wait on a peer, or its own
    checksum: str | None = None
    total_s: float | None = None
    step_s: tuple[float, ...] = ()
    stages: tuple[StageRecord, ...] = ()
    peak_bytes: int | None = None
    memory_source: str | None = None
    video: Any = None  # uint8 (frames, height, width, 3), when asked for and decoded here
    cancelled_after: int | None = None  # cancelled (CancelAt) after this step, from 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    """Cancel a request between denoising steps: say the step after which this rank will
    wait for the step every rank stops after (CancelPoint; answered by the rank's reader
    thread, whatever its main thread is doing)."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelPoint:
    """Where a rank waits in a request being cancelled: after step `step` (from 0), the step
    after its last one made; it makes no step past it before CancelAt says."""

    request_id: str
    rank: int
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelAt:
    """Every rank stops the request after step `step` (the latest CancelPoint: no rank is
    past it, so none is left in a collective its peers never enter); None: the cancel is
    withdrawn (not every rank said where it can stop) and the request goes on."""

    request_id: str
    step: int | None
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Stop:
    """Stop serving: journal the stop (with the launcher's signal, if any) and leave."""

    reason: str
    signal: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class GivenUp:
    """The server gave up the rank's request: it reported no step for `silent_s` (answered by
    the rank's reader thread, since its main thread is stuck in the request)."""

    request_id: str
    silent_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Dump:
    """Write the collective ring to the journal now (answered by the rank's reader thread, so
    a rank stuck in a collective still does)."""

    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost:
    """Under torchrun, rank `rank` is lost: rank 0 (its broadcasts ended without a stop), or
    this rank itself (silent past the beat's limit, so that the group went on without it).
    This rank fails, and leaves its serve loop. Put by the rank's own bridge, never sent."""

    why: str
    rank: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """How many messages the rank has dropped so far on `channel` of the rendezvous store or
    the control group, as not sealed with the run's store key (for /metrics)."""

    rank: int
    channel: str
    total: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Rest:
    """Put the rank to sleep (`wake` false: ready to asleep, its weights let go to the keeper)
    or wake it (asleep, waking, ready: its weights back and verified); answered by a Result of
    `request_id`, as a request is."""

    request_id: str
    wake: bool


ToRank = Generate | Stop | Dump | GivenUp | Lost | Cancel | CancelAt | Rest
FromRank = Hello | Ready | Progress | Result | Rejected | CancelPoint
