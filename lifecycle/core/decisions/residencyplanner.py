"""The residency planner: which residency option each component runs with, chosen from what
the calibration measured (pure: no torch, no I/O).

A pipeline declares, per component, the options it can run with and what each is expected to
do against the option it runs with before any plan (its reference): scale the component's
working memory (its stage peak above the request's baseline) and its time, give back resident
bytes while the other components run (offloading), and add time to bring them back. The
calibration measures each component once, at the probe's shape and on the reference options;
the planner predicts every combination from that and picks the fastest that fits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lifecycle.core.errors import ConfigError
from lifecycle.core.format.records import (
    ComponentCost,
    PlannerInput,
    ResidencyOption,
    ResidencyPlan,
    probe_reserve_bytes,
)
from lifecycle.core.format.text import format_bytes

MIB = 2**20


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}  # fmt: skip


# The largest size taken, whatever its unit: past any device's memory, well inside 64 bits.
MAX_SIZE = 2**60


def parse_size(text: str) -> int:
    """Bytes from `600MiB`, `2GiB`, `1.5G` or a plain number of bytes, up to MAX_SIZE;
    ConfigError otherwise, its message about the text alone (the option or key it was given
    under is named where it was given)."""
    raw = text.strip().lower().replace(" ", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}..."
    if unit not in _SIZE_UNITS or not (math.isfinite(value) and value > 0):
        raise ConfigError(
            f"{shown} is not a size such as 600MiB, 2GiB or 1.5G", field="memory_budget_bytes"
        )
    size = value * _SIZE_UNITS[unit]
    if not size <= MAX_SIZE:
        raise ConfigError(f"{shown} is more than 2**60 bytes (1 EiB)", field="memory_budget_bytes")
    return int(size)


def components(options: Sequence[ResidencyOption]) -> tuple[str, ...]:
    """The components the options name, in the order they are first named."""
    return tuple(dict.fromkeys(o.component for o in options))


def reference_choices(options: Sequence[ResidencyOption]) -> tuple[ResidencyOption, ...]:
    """The reference option of each component: what rolling back restores."""
    return tuple(
        next(o for o in options if o.component == c and o.reference) for c in components(options)
    )


def check_options(options: Sequence[ResidencyOption]) -> str | None:
    """Why a pipeline's declared options cannot be planned with, or None when they can."""
    for component in components(options):
        refs = [o for o in options if o.component == component and o.reference]
        if len(refs) != 1:
            return f"component {component} declares {len(refs)} reference options, not 1"
    if any(o.peak_scale < 0 or o.time_scale <= 0 or o.released_bytes < 0 for o in options):
        return "an option declares a negative peak scale or released bytes, or a time scale <= 0"
    return None


def predict(
    baseline_bytes: int, costs: Sequence[ComponentCost], choices: Sequence[ResidencyOption]
) -> tuple[int, float]:
    """The request's predicted peak and time when each component runs with its choice.

    A component's stage peaks at the baseline, less what the other components released, plus
    its own working memory scaled by its option; the request peaks at its highest stage.
    """
    chosen = {o.component: o for o in choices}
    released = sum(o.released_bytes for o in choices)
    peak = baseline_bytes
    seconds = 0.0
    for cost in costs:
        option = chosen.get(cost.component)
        if option is None:
            peak = max(peak, cost.peak_bytes - released)
            seconds += cost.seconds
            continue
        working = max(0, cost.peak_bytes - baseline_bytes)
        others = released - option.released_bytes
        peak = max(peak, baseline_bytes - others + round(working * option.peak_scale))
        seconds += cost.seconds * option.time_scale + option.reload_s
    # An option of a component no stage measures (Wan 2.2's expert not in use) still costs its
    # reloads: without them, releasing it would look free.
    measured = {cost.component for cost in costs}
    seconds += sum(o.reload_s for o in choices if o.component not in measured)
    return peak, seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One combination of options, with what one rank predicts it costs."""

    choices: tuple[ResidencyOption, ...]
    peak_bytes: int
    seconds: float
    fits: bool  # its peak with the headroom is within the budget


def candidates(given: PlannerInput) -> tuple[Candidate, ...]:
    """Every combination of the declared options (one per component), in declared order."""
    per_component = [
        [o for o in given.options if o.component == c] for c in components(given.options)
    ]
    limit = given.budget_bytes - given.headroom_bytes
    found = []
    for combo in itertools.product(*per_component):
        peak, seconds = predict(given.baseline_bytes, given.costs, combo)
        found.append(
            Candidate(choices=tuple(combo), peak_bytes=peak, seconds=seconds, fits=peak <= limit)
        )
    return tuple(found)


def choose(tables: Sequence[Sequence[Candidate]]) -> tuple[int, bool]:
    """The combination every rank runs, from each rank's candidates (the same combinations in
    the same order): the fastest, by its slowest rank, that fits on every rank (ties: the lower
    peak, then the declared order); when none does, the one with the lowest peak on its
    fullest rank. Returns its index and whether it fits everywhere."""
    count = min(len(t) for t in tables)
    fits = [i for i in range(count) if all(t[i].fits for t in tables)]

    def seconds(i: int) -> float:
        return max(t[i].seconds for t in tables)

    def peak(i: int) -> int:
        return max(t[i].peak_bytes for t in tables)

    if fits:
        return min(fits, key=lambda i: (seconds(i), peak(i), i)), True
    return min(range(count), key=lambda i: (peak(i), seconds(i), i)), False


def replan(given: Sequence[PlannerInput]) -> list[ResidencyPlan] | None:
    """Every rank's plan decided again from the inputs it journaled (in rank order), agreeing
    as the ranks did; None when their options differ in number (no plan is common to them)."""
    tables = [candidates(g) for g in given]
    if not tables or len({len(t) for t in tables}) != 1:
        return None
    agreed = choose(tables)
    return [plan_residency(g, agreed=agreed) for g in given]


def same_plan(recorded: ResidencyPlan, decided: ResidencyPlan) -> bool:
    """Whether a journaled plan is the one its inputs decide: the same choices, fitting or not
    alike, with the same predicted peak (the reason's words may change between versions)."""
    return (recorded.choices, recorded.fits, recorded.predicted_peak_bytes) == (
        decided.choices,
        decided.fits,
        decided.predicted_peak_bytes,
    )


def plan_residency(given: PlannerInput, *, agreed: tuple[int, bool] | None = None) -> ResidencyPlan:
    """This rank's plan: the fastest combination whose predicted peak, with the probe's
    headroom, fits the budget, or the one the ranks `agreed` on (see `choose`); when none
    fits, the combination with the lowest peak, marked as not fitting, with the reason."""
    table = candidates(given)
    index, fits = agreed if agreed is not None else choose([table])
    pick = table[index]
    headroom, budget = format_bytes(given.headroom_bytes), format_bytes(given.budget_bytes)
    if fits:
        reason = (
            f"fastest of {len(table)} plans that fit on every rank: peak"
            f" {format_bytes(pick.peak_bytes)} predicted + {headroom} headroom within the budget"
            f" of {budget}"
        )
    else:
        reason = (
            f"none of {len(table)} plans fits on every rank: the smallest predicted peak is"
            f" {format_bytes(pick.peak_bytes)}, and with {headroom} headroom that exceeds the"
            f" budget of {budget}"
        )
    return ResidencyPlan(
        choices=pick.choices,
        predicted_peak_bytes=pick.peak_bytes,
        predicted_s=pick.seconds,
        budget_bytes=given.budget_bytes,
        headroom_bytes=given.headroom_bytes,
        fits=fits,
        reason=reason,
    )


def default_budget(*, free_bytes: int, total_bytes: int) -> int:
    """The budget when none is given: the device's free memory less the probe's headroom."""
    return max(0, free_bytes - probe_reserve_bytes(total_bytes))


# A re-warm may measure this much above its prediction before the prediction counts as wrong:
# RSS moves by allocator caching and page granularity, not only by what the plan changed.
PREDICTION_SLACK = 1.25
PREDICTION_SLACK_BYTES = 64 * MIB
# A plan is verified on time too: its re-warm may take at most this much longer than predicted
# (a request's time on a shared machine varies by more than its memory does: two boots at
# once on two cores double it, and a one-rank boot beside a four-rank one measured more than
# twice its prediction plus a second, and a sub-second request beside three busy workers
# more than three times plus two, which must not roll a sound plan back). A plan that really
# costs time (offloading every step of a request of tens of seconds) is slower by far more.
TIME_SLACK = 3.0
TIME_SLACK_S = 5.0


def verify_time(*, measured_s: float, predicted_s: float) -> str | None:
    """Why a measured request time fails a plan's verification, or None when it holds: no
    more than TIME_SLACK times the prediction, plus TIME_SLACK_S."""
    if measured_s > predicted_s * TIME_SLACK + TIME_SLACK_S:
        return (
            f"measured request time {measured_s:.2f} s is far above the predicted"
            f" {predicted_s:.2f} s: the plan is slower than planned"
        )
    return None


def verify_peak(*, measured_bytes: int, predicted_bytes: int, budget_bytes: int) -> str | None:
    """Why a measured peak fails a plan's verification, or None when it holds: the peak must be
    within the budget, and near enough its prediction that the predictions can be trusted."""
    if measured_bytes > budget_bytes:
        return (
            f"measured peak {format_bytes(measured_bytes)} exceeds the budget of"
            f" {format_bytes(budget_bytes)} (predicted {format_bytes(predicted_bytes)})"
        )
    if measured_bytes > predicted_bytes * PREDICTION_SLACK + PREDICTION_SLACK_BYTES:
        return (
            f"measured peak {format_bytes(measured_bytes)} is far above the predicted"
            f" {format_bytes(predicted_bytes)}: the plan's predictions do not hold"
        )
    return None
