"""What a verified residency plan is keyed by, and the rule that decides whether a later startup
may reuse one (pure)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

from lifecycle.core.format.phrases import reuse_text
from lifecycle.core.format.records import (
    Fingerprint,
    ResidencyPlan,
    ReuseCode,
    ReuseDecision,
)
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.dtypes import AUTO
from lifecycle.core.settings.modelspec import ModelSpec

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
        # --dtype changes what every plan measures; at auto the digest is the model's alone,
        # so that plans verified before --dtype existed are still found.
        model_config=model_digest(args.model)
        if args.dtype == AUTO
        else f"{model_digest(args.model)} dtype={args.dtype}",
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
    """The reuse decision: the plan to apply (None: calibrate) and why, as a code with its
    facts (`reason` puts it into words)."""

    stored: StoredPlan | None
    decision: ReuseDecision

    @property
    def reason(self) -> str:
        return reuse_text(self.decision)


def _about(code: ReuseCode, stored: StoredPlan, **facts: Any) -> ReuseDecision:
    """A decision about `stored`: the code with the plan and the run that made it."""
    return ReuseDecision(
        code=code.value, model=stored.fingerprint.model, plan_id=stored.plan.plan_id,
        run_id=stored.run_id, **facts,
    )  # fmt: skip


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
            rolled_back = _about(ReuseCode.ROLLED_BACK, newest, note=newest.note)
            return Reuse(stored=None, decision=rolled_back)
        needed = newest.plan.predicted_peak_bytes + newest.plan.headroom_bytes
        if needed > budget_bytes:
            over = _about(
                ReuseCode.OVER_BUDGET, newest, needed_bytes=needed, budget_bytes=budget_bytes
            )
            return Reuse(stored=None, decision=over)
        reused = _about(ReuseCode.REUSED, newest)
        verified_in = newest.verified_in or newest.run_id
        return Reuse(stored=newest, decision=replace(reused, run_id=verified_in))
    if same:
        return Reuse(stored=None, decision=_about(ReuseCode.NEVER_VERIFIED, same[0]))
    if not stored:
        none_yet = ReuseDecision(code=ReuseCode.NO_PLAN.value, model=mine.model)
        return Reuse(stored=None, decision=none_yet)
    newest = stored[0]
    theirs = newest.fingerprint
    if _version(theirs.lifecycle) > _version(mine.lifecycle):
        newer = _about(
            ReuseCode.NEWER_LIFECYCLE, newest, lifecycle=theirs.lifecycle,
            own_lifecycle=mine.lifecycle,
        )  # fmt: skip
        return Reuse(stored=None, decision=newer)
    differs = _about(ReuseCode.FINGERPRINT_DIFFERS, newest, differs=mine.differences(theirs))
    return Reuse(stored=None, decision=differs)
