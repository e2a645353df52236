"""Evidence items: the facts a verdict rests on, each a code with typed fields and no prose.

Every string an item holds is an identifier, a state or group name, or text copied from the
journal (an error's type and message, a signal's name, a shutdown's reason); the sentences a
person reads are made from these by `replay.verdict.summary` and `lifecycle.verdict.headline`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from lifecycle.core.errors import ErrorKind
from lifecycle.verdict.analysis import MismatchReason, SplitDisagreement


class Code(StrEnum):
    FIRST_ERROR = "first-error"
    BLOCKED = "blocked"
    LATE_ARRIVAL = "late-arrival"
    MISMATCH = "mismatch"
    MISSING_RANK = "missing-rank"
    STOPPED_BY_SIGNAL = "stopped-by-signal"
    SHUT_DOWN = "shut-down"
    CRASHED_SILENT = "crashed-silent"
    PID_DEAD = "pid-dead"
    CUT_OFF = "cut-off"
    NO_PROGRESS = "no-progress"
    CONNECTION_BROKE = "connection-broke"
    NEVER_ENTERED = "never-entered"
    BROKEN_BY_STOP = "broken-by-stop"
    ENDED_AT_TIMEOUT = "ended-at-timeout"
    ABORTED = "aborted"
    ENVIRONMENT = "environment"
    SLOW_RANK = "slow-rank"
    STRAGGLER = "straggler"


class WaitEnd(StrEnum):
    """How a wait in a collective ended, as far as the journal tells."""

    WAITING = "waiting"  # still waiting when the journal ends
    TIMED_OUT = "timed-out"
    BROKE = "broke"  # the collective failed otherwise (a peer gone, another error)
    ABORTED = "aborted"  # the rank stopped waiting: a peer had failed (the agreed abort)


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """Base of the evidence items; `code` names the kind of fact."""

    code: ClassVar[Code]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEvidence(Evidence):
    """A fact about one rank."""

    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstError(RankEvidence):
    """The first fatal error a rank journaled."""

    code: ClassVar[Code] = Code.FIRST_ERROR
    kind: ErrorKind
    error_type: str  # as journaled
    message: str  # as journaled
    state: str
    at_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Blocked(RankEvidence):
    """A rank waiting in a collective, or failed because that collective timed out or broke."""

    code: ClassVar[Code] = Code.BLOCKED
    group: str
    group_seq: int
    op: str
    purpose: str
    waited_s: float
    waiting_for: tuple[int, ...]  # members that never started it
    ended: WaitEnd
    from_heartbeat: bool = False  # placed by its last heartbeat: the seq may be one behind
    # Seen by PyTorch's Flight Recorder only (the group is torch's), entered in `state`.
    from_flight_recorder: bool = False
    state: str | None = None
    caller: str | None = None  # "file.py:line function", from the dump


@dataclass(frozen=True, slots=True, kw_only=True)
class LateArrival(RankEvidence):
    """A rank that entered a collective only after a peer had given up waiting there."""

    code: ClassVar[Code] = Code.LATE_ARRIVAL
    group: str
    group_seq: int
    entered_s: float
    peer: int
    peer_gave_up_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Mismatched(Evidence):
    """Members of a group that ran different collectives at one sequence number."""

    code: ClassVar[Code] = Code.MISMATCH
    group: str
    group_seq: int
    ranks: tuple[int, ...]
    reason: MismatchReason
    split: SplitDisagreement | None


@dataclass(frozen=True, slots=True, kw_only=True)
class MissingRank(RankEvidence):
    """A rank of the run's world with no event in the journals given."""

    code: ClassVar[Code] = Code.MISSING_RANK


@dataclass(frozen=True, slots=True, kw_only=True)
class StoppedBySignal(RankEvidence):
    code: ClassVar[Code] = Code.STOPPED_BY_SIGNAL
    signal: str  # as journaled
    state: str  # where it was working when the stop came


@dataclass(frozen=True, slots=True, kw_only=True)
class ShutDown(RankEvidence):
    """Stopped before ready, not by a signal."""

    code: ClassVar[Code] = Code.SHUT_DOWN
    reason: str | None  # as journaled; None when it journaled no shutdown
    state: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashedSilent(RankEvidence):
    """A rank whose journal ends with no heartbeat after its last event."""

    code: ClassVar[Code] = Code.CRASHED_SILENT
    last_event_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PidDead(RankEvidence):
    """The reader saw the rank's process gone (on the reader's host)."""

    code: ClassVar[Code] = Code.PID_DEAD
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CutOff(RankEvidence):
    """A peer finished a collective with this rank that it never journaled starting."""

    code: ClassVar[Code] = Code.CUT_OFF
    group: str
    started: int  # the highest sequence number this rank journaled starting
    peer: int
    peer_finished: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NoProgress(RankEvidence):
    """Alive (heartbeats go on) but no progress in its state."""

    code: ClassVar[Code] = Code.NO_PROGRESS
    state: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionBroke(RankEvidence):
    """A peer waiting for this rank saw its connection to it close: this rank died."""

    code: ClassVar[Code] = Code.CONNECTION_BROKE
    peer: int


@dataclass(frozen=True, slots=True, kw_only=True)
class NeverEntered(RankEvidence):
    """A peer waited for this rank in a collective that this rank never entered."""

    code: ClassVar[Code] = Code.NEVER_ENTERED
    peer: int
    group: str
    group_seq: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EndedAtTimeout(RankEvidence):
    """Its journal ends, with no error of its own, as the timeout of the collective it waited
    in ran out: NCCL's watchdog ends a process then. It waited; it did not go wrong."""

    code: ClassVar[Code] = Code.ENDED_AT_TIMEOUT
    waited_s: float
    timeout_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class AbortedBy(RankEvidence):
    """It stopped because a peer announced a failure for good (the agreed abort): it did not
    go wrong itself. `failed_rank` is None when the rendezvous store itself went away."""

    code: ClassVar[Code] = Code.ABORTED
    failed_rank: int | None
    error_type: str
    state: str  # where this rank was when it learned it
    learned_after_s: float
    announced_by: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokenByStop(RankEvidence):
    """Its collective broke only after the run was being stopped by a signal."""

    code: ClassVar[Code] = Code.BROKEN_BY_STOP
    at_s: float
    stopped_at_s: float  # when the first rank journaled a stop by a signal


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvironmentDiffers(RankEvidence):
    """At gate-check this rank ran on another `value` of a field than most of its group
    (`expected`); `matters` when the field changes numerics or collectives (it failed the
    startup)."""

    code: ClassVar[Code] = Code.ENVIRONMENT
    field: str
    value: str
    expected: str
    matters: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowAtGate(RankEvidence):
    """gate-check measured this rank below the threshold of its group's median speed."""

    code: ClassVar[Code] = Code.SLOW_RANK
    measure: str  # "compute" or "link"
    group: str
    figure_s: float
    median_s: float
    ratio: float
    threshold: float
    action: str  # "warn" or "fail"


@dataclass(frozen=True, slots=True, kw_only=True)
class Straggling(RankEvidence):
    """While serving, this rank entered its group's collectives consistently late: the median
    of its latest requests' lags."""

    code: ClassVar[Code] = Code.STRAGGLER
    group: str
    median_lag_s: float
    requests: int
