"""The residency planner's events: planned, applied, verified, rolled back; each carries the
plan and its fingerprint (part of the journal's format, as every kind in
lifecycle.core.format.events)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.format.kinds.eventkind import Event
from lifecycle.core.format.records import Fingerprint, PlannerInput, ResidencyPlan, ReuseDecision


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyEvent(Event):
    """A step of the residency planner: every one carries the plan and its fingerprint, so the
    newest of a run says how its plan ended (what a later startup decides reuse from)."""

    fingerprint: Fingerprint
    plan: ResidencyPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyPlanned(ResidencyEvent):
    """The planner's decision after the probe, with the inputs it decided from; `reuse` says
    why no earlier plan was reused (a code and its facts; version 1 held a sentence)."""

    kind: ClassVar[str] = "residency_planned"
    version: ClassVar[int] = 2
    given: PlannerInput
    reuse: ReuseDecision


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyApplied(ResidencyEvent):
    """A plan applied: before re-warm after calibration, or before bounded-warm when reused
    (`reused_from` names the run that verified it)."""

    kind: ClassVar[str] = "residency_applied"
    reused_from: str | None
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyVerified(ResidencyEvent):
    """Every rank's re-warm measured within the budget and near its prediction, in memory and
    (version 2) in time; a version 1 event has no times (None)."""

    kind: ClassVar[str] = "residency_verified"
    version: ClassVar[int] = 2
    measured_bytes: int
    predicted_bytes: int  # at the re-warm's shape
    measured_s: float | None = None  # the re-warm request's time
    predicted_s: float | None = None  # the planner's for it


@dataclass(frozen=True, slots=True, kw_only=True)
class ResidencyRolledBack(ResidencyEvent):
    """A rank could not apply or verify the plan: every rank went back to its reference
    residency; `ranks` are the ranks that failed, `reason` this rank's own or theirs."""

    kind: ClassVar[str] = "residency_rolled_back"
    reason: str
    ranks: tuple[int, ...]
