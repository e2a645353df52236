"""Records nested in journal events: part of the journal format (change any of them only with a
version bump of every event kind that holds it, and an upcaster)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from operator import attrgetter
from typing import Any


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
class PhaseTime:
    """A stretch of a rank's startup before its journal opened (the interpreter's start, an
    import), by name and length; the rest of its startup is journaled as it happens."""

    name: str
    seconds: float


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    width: int
    height: int
    frames: int

    @property
    def area(self) -> int:
        return self.width * self.height

    @property
    def pixels(self) -> int:
        return self.width * self.height * self.frames

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Platform:
    """What the device can do and hold, probed once at gate-check."""

    device: str  # "cuda" or "cpu"
    name: str
    total_bytes: int
    free_bytes: int
    peak_source: str | None  # "cuda-allocator", "linux-vmhwm", or None when unmeasurable

    @property
    def can_measure_peak(self) -> bool:
        return self.peak_source is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class GateOutcome:
    name: str
    passed: bool
    reason: str


class Role(StrEnum):
    BOUNDED = "bounded"
    PROBE = "probe"
    REWARM = "rewarm"
    LEARNED = "learned"  # a shape the fingerprint's traffic used, or one --warm-shape names


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupRequest:
    role: Role
    shape: Shape
    steps: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeFit:
    """How the probe shape was fitted to free memory."""

    default: Shape
    fitted: Shape | None  # None when not even the smallest candidate fits
    estimated_peak_bytes: int
    budget_bytes: int
    free_bytes: int
    reserve_bytes: int
    frame_shrinks: int
    area_shrinks: int


def probe_reserve_bytes(total_bytes: int) -> int:
    """The memory a probe and a plan leave free: 2 % of the device, at least a GiB."""
    return max(2**30, total_bytes // 50)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyOption:
    """One way a component can run, and its expected effect against the reference option."""

    component: str
    name: str
    peak_scale: float  # the component's working memory against the reference option's
    time_scale: float  # the component's time against the reference option's
    released_bytes: int = 0  # resident bytes given back while the other components run
    reload_s: float = 0.0  # time added to every request (bringing released weights back)
    reference: bool = False  # what the pipeline runs with before a plan, and after a rollback


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentCost:
    """What one request measured of one component: its time and its stage's peak bytes."""

    component: str
    seconds: float
    peak_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannerInput:
    """Everything the planner decides from; journaled with the plan, so that `replay verify`
    can decide again and compare."""

    baseline_bytes: int  # the request's baseline (in use before it started)
    costs: tuple[ComponentCost, ...]  # measured on the reference options
    options: tuple[ResidencyOption, ...]
    total_bytes: int
    free_bytes: int
    budget_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return probe_reserve_bytes(self.total_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyPlan:
    """One option per component, what it is predicted to cost, and why it was chosen."""

    choices: tuple[ResidencyOption, ...]
    predicted_peak_bytes: int
    predicted_s: float
    budget_bytes: int
    headroom_bytes: int
    fits: bool
    reason: str

    @property
    def plan_id(self) -> str:
        """A short, stable name: the non-reference choices, or `reference`."""
        changed = [f"{o.component}={o.name}" for o in self.choices if not o.reference]
        return ",".join(changed) or "reference"

    @property
    def changes_residency(self) -> bool:
        return any(not o.reference for o in self.choices)


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """Everything that may change what a plan measures: a plan verified under one fingerprint
    is reused only under the same one."""

    model: str
    model_config: str  # a digest of the model's specification
    default_shape: str
    layout: str
    device: str
    total_bytes: int
    torch: str
    lifecycle: str
    budget: str  # --memory-budget in bytes, or DEFAULT_BUDGET

    @property
    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def differences(self, other: Fingerprint) -> tuple[str, ...]:
        """The fields in which `other` differs from this fingerprint, by name."""
        return tuple(
            f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)
        )


class ReuseCode(StrEnum):
    """Why a startup reuses a verified residency plan, or why it does not."""

    REUSED = "reused"  # the verified plan of `run_id` is reused
    NOT_EVERY_RANK = "not-every-rank"  # this rank found it, some rank did not
    CALIBRATE_ASKED = "calibrate-asked"  # it could have been reused; --calibrate said no
    ROLLED_BACK = "rolled-back"  # the newest plan rolled back (`note`: why)
    OVER_BUDGET = "over-budget"  # it needs more than today's budget
    NEVER_VERIFIED = "never-verified"
    NOT_REPLANNED = "not-replanned"  # its journaled inputs do not decide it (edited, forged)
    NEWER_LIFECYCLE = "newer-lifecycle"  # made by a newer lifecycle (`lifecycle`)
    FINGERPRINT_DIFFERS = "fingerprint-differs"  # the newest plan's fingerprint (`differs`)
    NO_PLAN = "no-plan"  # no plan for the model yet
    NO_OPTIONS = "no-options"  # the pipeline declares no residency options
    UNREADABLE = "unreadable"  # the journal's plans (or a plan's inputs) could not be read
    BAD_OPTIONS = "bad-options"  # the declared options cannot be planned with (`note`)
    NO_MEMORY = "no-memory"  # the probe measured no memory
    NO_DECISION = "no-decision"  # no reuse decision was made
    TEXT = "text"  # a journal from before codes: its sentence, in `note`


@dataclass(frozen=True, slots=True, kw_only=True)
class ReuseDecision:
    """The reuse decision as the journal keeps it: a code and the facts it needs; the CLI and
    replay put it into words (core/phrases.py)."""

    code: str  # a ReuseCode value
    model: str = ""
    plan_id: str = ""
    run_id: str = ""  # the run whose plan it is (that verified it, when reused)
    note: str = ""
    needed_bytes: int = 0
    budget_bytes: int = 0
    lifecycle: str = ""  # the lifecycle version that made the plan
    own_lifecycle: str = ""  # and this startup's, where they differ
    differs: tuple[str, ...] = ()  # the fingerprint's fields that differ


@dataclass(frozen=True, slots=True, kw_only=True)
class ChosenShape:
    """A shape a startup warms after the bounded warmup: at how many steps, how many served
    requests used it (0 for one --warm-shape names), and what warming it is expected to cost
    (None: --warm-shape's, outside the budget), a compile included under --compile."""

    shape: Shape
    steps: int
    served: int
    expected_s: float | None
    compile_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SkippedShape:
    """A learned shape not warmed, and why (past the budget, no known cost, not runnable)."""

    shape: Shape
    why: str
