"""Event kinds: the frozen dataclasses a journal holds, and the envelope of a stored one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.errors import classify

# The process group's kinds and the residency planner's live in modules of their own
# (lifecycle.core.format.kinds) and are listed here with the rest.
from lifecycle.core.format.kinds.compileevents import (
    Compiled,
    CompileEvent,
    CompileKept,
    ShapesChosen,
)
from lifecycle.core.format.kinds.eventkind import Event
from lifecycle.core.format.kinds.groupevents import (
    Aborted,
    BuffersAllocated,
    BuffersDropped,
    ClockAligned,
    CollectiveFinished,
    CollectivesDumped,
    CollectiveStarted,
    FlightRecorderDumped,
    Heartbeat,
    Stalled,
)
from lifecycle.core.format.kinds.rankevents import (
    EnvironmentChecked,
    RankCheckEvent,
    RankProbed,
    SlowRank,
)
from lifecycle.core.format.kinds.residencyevents import (
    ResidencyApplied,
    ResidencyEvent,
    ResidencyPlanned,
    ResidencyRolledBack,
    ResidencyVerified,
)
from lifecycle.core.format.kinds.weightevents import (
    AttachRejected,
    ReferenceOutput,
    WeightsKept,
    WeightsPath,
    WeightsReleased,
)
from lifecycle.core.format.records import (
    GateOutcome,
    GroupMark,
    PhaseTime,
    Platform,
    ProbeFit,
    RequestResult,
    Role,
    Shape,
    StateExpectation,
    WarmupRequest,
)

__all__ = [
    "EVENT_TYPES",
    "Aborted",
    "ActionFinished",
    "ActionStarted",
    "AttachRejected",
    "BuffersAllocated",
    "BuffersDropped",
    "ClockAligned",
    "CollectiveFinished",
    "CollectiveStarted",
    "CollectivesDumped",
    "CompileEvent",
    "CompileKept",
    "Compiled",
    "EnvironmentChecked",
    "Error",
    "Event",
    "Expectations",
    "FaultInjected",
    "FlightRecorderDumped",
    "GateDecided",
    "Heartbeat",
    "LoadEvent",
    "LoadFinished",
    "LoadStarted",
    "PlanBuilt",
    "RankCheckEvent",
    "RankProbed",
    "ReferenceOutput",
    "RequestFinished",
    "RequestStarted",
    "ResidencyApplied",
    "ResidencyEvent",
    "ResidencyPlanned",
    "ResidencyRolledBack",
    "ResidencyVerified",
    "RunStarted",
    "ShapesChosen",
    "Shutdown",
    "SlowRank",
    "Stalled",
    "StoredEvent",
    "Transition",
    "UnknownEvent",
    "WarmupRecord",
    "WeightsKept",
    "WeightsPath",
    "WeightsReleased",
    "error_event",
]

# Nested records (lifecycle.core.format.records), and the domain values the events below hold
# (Shape, Platform, GateOutcome, WarmupRequest, ProbeFit, Role, and the residency planner's
# values), are part of the journal format: change any of them only with a version bump of every
# kind that holds it, and an upcaster.

# ---------------------------------------------------------------------------------------------
# Event kinds


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted(Event):
    """A rank's start. Version 2 adds its launch phase, the time before `created` that the
    field counts in "startup to healthy": when the launcher (or torchrun's agent) and this
    rank's process began, on this rank's clock, and how long its imports took (None for a
    version 1 event). Version 3 splits that time into its phases (the interpreter's start,
    each library's import, the journal's opening), in order."""

    kind: ClassVar[str] = "run_started"
    version: ClassVar[int] = 3
    world_size: int
    host: str
    pid: int
    lifecycle_version: str
    torch_version: str | None
    python_version: str
    device: str
    dist_backend: str | None
    launcher_started_wall: float | None = None
    process_started_wall: float | None = None
    imports_s: float | None = None
    phases: tuple[PhaseTime, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Expectations(Event):
    """What this rank expects of each startup state, from the journal's earlier healthy runs
    of the same fingerprint and path (`key`): each state's median, p95 and count, and the
    deadline past which it is stalled; journaled at gate-check once the path is known. No
    states (with `runs` below the minimum) means no history: the fixed --state-deadline."""

    kind: ClassVar[str] = "expectations"
    version: ClassVar[int] = 1
    key: str
    runs: int
    states: tuple[StateExpectation, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GateDecided(Event):
    kind: ClassVar[str] = "gate_decided"
    skip_reason: str | None
    local_skip_reason: str | None  # this rank's own decision before the ranks agreed
    gates: tuple[GateOutcome, ...]
    platform: Platform


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanBuilt(Event):
    """Version 2 nests each request's and the probe fit's shapes (version 1 flattened them)."""

    kind: ClassVar[str] = "plan_built"
    version: ClassVar[int] = 2
    skip_reason: str | None
    requests: tuple[WarmupRequest, ...]
    probe_fit: ProbeFit | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Transition(Event):
    kind: ClassVar[str] = "transition"
    trigger: str
    source: str
    dest: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionStarted(Event):
    kind: ClassVar[str] = "action_started"
    action: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionFinished(Event):
    kind: ClassVar[str] = "action_finished"
    action: str
    duration_s: float
    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadEvent(Event):
    """A step of a pipeline component's load (the startup accounted)."""

    component: str


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStarted(LoadEvent):
    """A pipeline component's load began (journaled before it reads, so that a load that
    hangs leaves which component, and which files, on disk)."""

    kind: ClassVar[str] = "load_started"
    files: tuple[str, ...]  # its files, by name inside the model (the first MAX_LOAD_FILES)
    bytes: int  # their size


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadFinished(LoadEvent):
    """A component's load ended: how long it took in all, reading and building it apart from
    moving it to the device, the bytes it read and the dtype it holds."""

    kind: ClassVar[str] = "load_finished"
    seconds: float
    read_s: float
    device_s: float
    bytes: int
    dtype: str | None
    ok: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupRecord(Event, RequestResult):
    """One warmup request's result, with its role in the plan and its tokens. Version 2 nests
    the shape (version 1 flattened it)."""

    kind: ClassVar[str] = "warmup_record"
    version: ClassVar[int] = 2
    role: Role
    tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Error(Event):
    """An error a rank recorded; `error_kind` (an ErrorKind value) says what went wrong, and
    `error_type` and `message` are only for people to read."""

    kind: ClassVar[str] = "error"
    version: ClassVar[int] = 2
    error_type: str
    error_kind: str
    message: str
    traceback: str
    trigger: str | None
    fatal: bool


def error_event(exc: BaseException, *, fatal: bool, trigger: str | None, traceback: str) -> Error:
    """The record of `exc`, classified as it is recorded."""
    return Error(
        error_type=type(exc).__name__,
        error_kind=classify(exc).value,
        message=str(exc),
        traceback=traceback,
        trigger=trigger,
        fatal=fatal,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    fault: str
    fault_kind: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestStarted(Event):
    """Version 2 nests the shape (version 1 flattened it); version 3 adds what else a request
    is asked with: the negative prompt's length, the guidance scale and the seed (None for a
    request journaled before them)."""

    kind: ClassVar[str] = "request_started"
    version: ClassVar[int] = 3
    request_id: str
    source: str  # "http" or "smoke"
    shape: Shape
    steps: int
    prompt_chars: int
    negative_prompt_chars: int = 0
    guidance_scale: float | None = None
    seed: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Event):
    """Version 2 adds what the request's collectives did (their records stay in the ring after
    ready): how many ran, and every group's progress when it ended; and, optional, the rank's
    lag entering them against its peers."""

    kind: ClassVar[str] = "request_finished"
    version: ClassVar[int] = 2
    request_id: str
    ok: bool
    total_s: float
    checksum: str | None
    peak_bytes: int | None
    collectives: int = 0
    groups: tuple[GroupMark, ...] = ()
    # The rank's lag entering the request's collectives against its peers (the median, in
    # the group where it lagged most); None on one rank, or when the request failed. Optional:
    # a journal without it reads as before.
    lag_s: float | None = None
    lag_group: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Event):
    kind: ClassVar[str] = "shutdown"
    reason: str
    signal: str | None
    events_written: int  # this rank's events before this one
    journal_write_s: float  # time this rank spent committing them


@dataclass(frozen=True, slots=True, kw_only=True)
class UnknownEvent(Event):
    """A row whose kind this lifecycle does not know, or whose payload does not decode."""

    kind: ClassVar[str] = "unknown"
    row_kind: str
    row_version: int
    reason: str
    raw: str


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls
    for cls in (
        RunStarted,
        GateDecided,
        PlanBuilt,
        Transition,
        ActionStarted,
        ActionFinished,
        LoadStarted,
        LoadFinished,
        Compiled,
        CompileKept,
        ShapesChosen,
        WeightsPath,
        WeightsKept,
        ReferenceOutput,
        AttachRejected,
        WeightsReleased,
        EnvironmentChecked,
        RankProbed,
        SlowRank,
        WarmupRecord,
        CollectiveStarted,
        CollectiveFinished,
        BuffersAllocated,
        BuffersDropped,
        Heartbeat,
        Stalled,
        Error,
        FaultInjected,
        RequestStarted,
        RequestFinished,
        CollectivesDumped,
        FlightRecorderDumped,
        ClockAligned,
        ResidencyPlanned,
        ResidencyApplied,
        ResidencyVerified,
        ResidencyRolledBack,
        Shutdown,
        Aborted,
        Expectations,
    )
}


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredEvent:
    """One journal row: the envelope (who, when, in which state) around a decoded event."""

    run_id: str
    rank: int
    seq: int
    wall_time: float
    mono_ns: int
    state: str  # the rank's state after this event
    event: Event

    @property
    def kind(self) -> str:
        event = self.event
        return event.row_kind if isinstance(event, UnknownEvent) else event.kind
