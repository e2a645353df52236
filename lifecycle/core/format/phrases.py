"""The words for codes the journal holds, shared by the CLI's console and replay (which read
core and store only): the journal keeps a code with its facts, these put it into a sentence."""

from __future__ import annotations

from lifecycle.core.format.records import ReuseCode, ReuseDecision
from lifecycle.core.format.text import format_bytes


def reuse_text(d: ReuseDecision) -> str:
    """Why a startup reused a verified residency plan, or did not, as one sentence."""
    plan, run = f"plan {d.plan_id}", f"run {d.run_id}"
    match d.code:
        case ReuseCode.REUSED:
            return f"verified residency plan {d.plan_id} from {run}"
        case ReuseCode.NOT_EVERY_RANK:
            return f"verified residency plan {d.plan_id} from {run}, but not every rank has it"
        case ReuseCode.CALIBRATE_ASKED:
            return (
                f"--calibrate asked for a calibration; verified residency plan {d.plan_id} from"
                f" {run} could have been reused"
            )
        case ReuseCode.ROLLED_BACK:
            return f"{plan} rolled back in {run} ({d.note}); it is not reused"
        case ReuseCode.OVER_BUDGET:
            return (
                f"{plan} from {run} needs {format_bytes(d.needed_bytes)} with headroom, more"
                f" than the budget of {format_bytes(d.budget_bytes)} now"
            )
        case ReuseCode.NEVER_VERIFIED:
            return f"{plan} from {run} never verified"
        case ReuseCode.NOT_REPLANNED:
            return (
                f"{plan} from {run} is not the plan its journaled inputs decide; it is not reused"
            )
        case ReuseCode.NEWER_LIFECYCLE:
            return (
                f"{plan} from {run} was made by lifecycle {d.lifecycle}, newer than this"
                f" {d.own_lifecycle}"
            )
        case ReuseCode.FINGERPRINT_DIFFERS:
            return (
                f"no plan for this fingerprint: the newest for {d.model} ({run}) differs in"
                f" {', '.join(d.differs)}"
            )
        case ReuseCode.NO_PLAN:
            return f"no residency plan for {d.model} yet"
        case ReuseCode.NO_OPTIONS:
            return f"{d.model} declares no residency options"
        case ReuseCode.UNREADABLE:
            where = f"the inputs of {run}'s plan" if d.run_id else "the journal's plans"
            return f"{where} could not be read: {d.note}"
        case ReuseCode.BAD_OPTIONS:
            return d.note
        case ReuseCode.NO_MEMORY:
            return "the probe measured no memory"
        case ReuseCode.NO_DECISION:
            return "no reuse decision"
        case _:  # TEXT, or a code from a newer lifecycle: what it holds
            return d.note or d.code


# What an operator can do about a closed calibration gate whose name says little by itself.
_SKIP_HINTS = {
    "no synthetic server warmup to calibrate from": (
        "the model's default request is within the bounded warmup, so calibration would"
        " measure nothing new; --calibrate (or a larger --default-shape) opens it"
    ),
}


def skip_hint(reason: str | None) -> str | None:
    """What a skip reason means for the operator, where its words alone do not say it."""
    return None if reason is None else _SKIP_HINTS.get(reason)
