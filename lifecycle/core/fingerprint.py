"""What a verified residency plan is keyed by, and the rule that decides whether a later startup
may reuse one (pure)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from lifecycle.core.config import ModelSpec, ServerArgs
from lifecycle.core.planner import format_bytes
from lifecycle.core.records import Fingerprint, ResidencyPlan

DEFAULT_BUDGET = "free memory less headroom"


def model_digest(model: ModelSpec) -> str:
    text = json.dumps(asdict(model), sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def fingerprint(
    args: ServerArgs, *, device: str, total_bytes: int, torch_version: str, lifecycle: str
) -> Fingerprint:
    budget = args.memory_budget_bytes
    return Fingerprint(
        model=args.model.name,
        model_config=model_digest(args.model),
        default_shape=str(args.model.default_shape),
        layout=f"ranks={args.num_ranks} cfg={args.cfg_parallel} ulysses={args.ulysses}",
        device=device,
        total_bytes=total_bytes,
        torch=torch_version,
        lifecycle=lifecycle,
        budget=DEFAULT_BUDGET if budget is None else str(budget),
    )


class PlanStatus(StrEnum):
    PLANNED = "planned"  # journaled, not (yet) verified: the run may have died before
    VERIFIED = "verified"
    ROLLED_BACK = "rolled-back"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredPlan:
    """A plan as the journal keeps it for reuse, one per run that made it."""

    run_id: str
    fingerprint: Fingerprint
    plan: ResidencyPlan
    status: PlanStatus
    note: str  # why it rolled back; empty otherwise
    verified_in: str = ""  # the run whose re-warm verified it (a reusing run carries it on)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reuse:
    """The reuse decision: the plan to apply (None: calibrate) and why, in words."""

    stored: StoredPlan | None
    reason: str


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def choose_reuse(mine: Fingerprint, stored: Sequence[StoredPlan], *, budget_bytes: int) -> Reuse:
    """The verified plan this startup may reuse, from the plans of the same model (newest
    first), and why; None with the reason when it must calibrate.

    The newest plan with this fingerprint that ended (verified or rolled back) decides: a plan
    that rolled back is never reused, and one that never verified is passed over. A plan from
    a newer lifecycle is not reused, nor one whose predicted peak no longer fits the budget.
    """
    same = [s for s in stored if s.fingerprint.key == mine.key]
    ended = [s for s in same if s.status is not PlanStatus.PLANNED]
    if ended:
        newest = ended[0]
        if newest.status is PlanStatus.ROLLED_BACK:
            return Reuse(
                stored=None,
                reason=f"plan {newest.plan.plan_id} rolled back in run {newest.run_id}"
                f" ({newest.note}); it is not reused",
            )
        needed = newest.plan.predicted_peak_bytes + newest.plan.headroom_bytes
        if needed > budget_bytes:
            return Reuse(
                stored=None,
                reason=f"plan {newest.plan.plan_id} from run {newest.run_id} needs"
                f" {format_bytes(needed)} with headroom, more than the budget of"
                f" {format_bytes(budget_bytes)} now",
            )
        return Reuse(
            stored=newest,
            reason=f"verified residency plan {newest.plan.plan_id} from run"
            f" {newest.verified_in or newest.run_id}",
        )
    if same:
        return Reuse(
            stored=None,
            reason=f"plan {same[0].plan.plan_id} from run {same[0].run_id} never verified",
        )
    if not stored:
        return Reuse(stored=None, reason=f"no residency plan for {mine.model} yet")
    newest = stored[0]
    theirs = newest.fingerprint
    if _version(theirs.lifecycle) > _version(mine.lifecycle):
        return Reuse(
            stored=None,
            reason=f"plan {newest.plan.plan_id} from run {newest.run_id} was made by lifecycle"
            f" {theirs.lifecycle}, newer than this {mine.lifecycle}",
        )
    changed = ", ".join(mine.differences(theirs))
    return Reuse(
        stored=None,
        reason=f"no plan for this fingerprint: the newest for {mine.model}"
        f" (run {newest.run_id}) differs in {changed}",
    )
