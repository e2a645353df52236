"""The residency planner, the reuse rule and the ranks' agreement: pure, with property tests."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.core.decisions.agreement import agreed_gate, agreed_rollback, reuse_token
from lifecycle.core.decisions.fingerprint import PlanStatus, StoredPlan, choose_reuse, fingerprint
from lifecycle.core.decisions.gates import GATES, RESIDENCY_GATE_INDEX
from lifecycle.core.decisions.residencyplanner import (
    candidates,
    check_options,
    choose,
    parse_size,
    plan_residency,
    predict,
    reference_choices,
    verify_peak,
    verify_time,
)
from lifecycle.core.errors import ConfigError, FaultSpecError
from lifecycle.core.format.records import ComponentCost, PlannerInput, ResidencyOption
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.faults import FaultKind, parse_fault
from lifecycle.core.settings.modelspec import MODEL_PRESETS

MIB = 2**20
GIB = 2**30


def option(component: str, name: str, **effect: float | int | bool) -> ResidencyOption:
    values: dict = {"peak_scale": 1.0, "time_scale": 1.0, **effect}  # type: ignore[type-arg]
    return ResidencyOption(component=component, name=name, **values)


OPTIONS = (
    option("vae", "whole", reference=True),
    option("vae", "all-frames", peak_scale=8.0, time_scale=0.8),
    option("vae", "tiles", peak_scale=0.5, time_scale=1.3),
    option("text_encoder", "resident", reference=True),
    option("text_encoder", "offloaded", released_bytes=200 * MIB, reload_s=0.5),
)
COSTS = (
    ComponentCost(component="text_encoder", seconds=0.1, peak_bytes=1 * GIB),
    ComponentCost(component="dit", seconds=4.0, peak_bytes=1 * GIB + 300 * MIB),
    ComponentCost(component="vae", seconds=2.0, peak_bytes=1 * GIB + 400 * MIB),
)


def given_budget(budget: int, *, options: tuple[ResidencyOption, ...] = OPTIONS) -> PlannerInput:
    return PlannerInput(
        baseline_bytes=1 * GIB,
        costs=COSTS,
        options=options,
        total_bytes=40 * GIB,
        free_bytes=30 * GIB,
        budget_bytes=budget,
    )


def test_prediction_scales_working_memory_and_releases_offloaded_weights() -> None:
    """A component's stage peaks at the baseline plus its working memory times its option's
    scale; an offloaded component's weights are given back while the others run."""
    chosen = (OPTIONS[1], OPTIONS[4])
    peak, seconds = predict(1 * GIB, COSTS, chosen)
    assert peak == 1 * GIB - 200 * MIB + 8 * 400 * MIB
    assert seconds == pytest.approx(0.1 + 0.5 + 4.0 + 2.0 * 0.8)
    reference, _ = predict(1 * GIB, COSTS, reference_choices(OPTIONS))
    assert reference == 1 * GIB + 400 * MIB


def test_the_fastest_plan_that_fits_wins_and_a_tight_budget_gets_a_smaller_one() -> None:
    """A roomy budget takes all frames at once (fastest); a budget it exceeds takes the
    reference decoder; one below that tiles and offloads."""
    headroom = GIB  # max(1 GiB, 40 GiB / 50)
    roomy = plan_residency(given_budget(20 * GIB))
    assert roomy.fits and roomy.plan_id == "vae=all-frames"
    assert roomy.predicted_peak_bytes + roomy.headroom_bytes <= 20 * GIB
    middle = plan_residency(given_budget(1 * GIB + 400 * MIB + headroom))
    assert middle.fits and middle.plan_id == "reference"
    tight = plan_residency(given_budget(1 * GIB + 150 * MIB + headroom))
    assert tight.fits and tight.plan_id == "vae=tiles,text_encoder=offloaded"
    assert "fastest of 6 plans that fit" in tight.reason


def test_when_no_plan_fits_the_planner_says_so_plainly() -> None:
    """Below every plan's peak plus headroom: not fitting, the smallest plan, and why."""
    plan = plan_residency(given_budget(1 * GIB))
    assert not plan.fits
    assert plan.plan_id == "vae=tiles,text_encoder=offloaded"
    assert plan.reason.startswith("none of 6 plans fits on every rank: the smallest predicted")
    assert "1.00 GiB headroom" in plan.reason


costs_st = st.tuples(st.floats(0.01, 10.0), st.floats(0.01, 10.0), st.floats(0.01, 10.0)).map(
    lambda s: (
        ComponentCost(component="text_encoder", seconds=s[0], peak_bytes=GIB),
        ComponentCost(component="dit", seconds=s[1], peak_bytes=GIB + int(s[1] * 100 * MIB)),
        ComponentCost(component="vae", seconds=s[2], peak_bytes=GIB + int(s[2] * 200 * MIB)),
    )
)
options_st = st.tuples(
    st.floats(0.1, 20.0), st.floats(0.2, 3.0), st.floats(0.1, 20.0), st.floats(0.2, 3.0),
    st.integers(0, 512 * MIB), st.floats(0.0, 2.0),
).map(
    lambda o: (
        option("vae", "whole", reference=True),
        option("vae", "a", peak_scale=o[0], time_scale=o[1]),
        option("vae", "b", peak_scale=o[2], time_scale=o[3]),
        option("text_encoder", "resident", reference=True),
        option("text_encoder", "offloaded", released_bytes=o[4], reload_s=o[5]),
    )
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    costs=costs_st,
    options=options_st,
    budget=st.integers(0, 8 * GIB),
    more=st.integers(0, 8 * GIB),
)
def test_plans_never_exceed_the_budget_and_more_budget_is_never_slower(
    costs: tuple[ComponentCost, ...],
    options: tuple[ResidencyOption, ...],
    budget: int,
    more: int,
) -> None:
    """Property: a plan that fits is predicted within the budget with the headroom, and a
    larger budget never gives a slower plan."""

    def planned(b: int):  # type: ignore[no-untyped-def]
        return plan_residency(
            PlannerInput(
                baseline_bytes=GIB,
                costs=costs,
                options=options,
                total_bytes=40 * GIB,
                free_bytes=30 * GIB,
                budget_bytes=b,
            )
        )

    small, large = planned(budget), planned(budget + more)
    for plan in (small, large):
        if plan.fits:
            assert plan.predicted_peak_bytes + plan.headroom_bytes <= plan.budget_bytes
    if small.fits:
        assert large.fits
        assert large.predicted_s <= small.predicted_s + 1e-9


def test_the_ranks_choose_a_plan_that_fits_on_every_rank() -> None:
    """The fastest combination by its slowest rank among those that fit on every rank: one
    that fits only on the rank with more room is not chosen."""
    roomy = candidates(given_budget(20 * GIB))
    tight = candidates(given_budget(1 * GIB + 400 * MIB + GIB))
    index, fits = choose([roomy, tight])
    assert fits
    assert choose([roomy])[0] != index
    assert plan_residency(given_budget(20 * GIB), agreed=(index, fits)).plan_id == "reference"
    none_index, none_fits = choose([roomy, candidates(given_budget(GIB))])
    assert not none_fits
    assert roomy[none_index].peak_bytes == min(c.peak_bytes for c in roomy)


def test_declared_options_need_one_reference_per_component() -> None:
    assert check_options(OPTIONS) is None
    extra = (*OPTIONS, option("vae", "again", reference=True))
    assert check_options(extra) == "component vae declares 2 reference options, not 1"
    assert "time scale" in (
        check_options((option("vae", "x", time_scale=0.0, reference=True),)) or ""
    )


def test_verification_holds_a_peak_to_the_budget_and_to_its_prediction() -> None:
    assert (
        verify_peak(measured_bytes=900 * MIB, predicted_bytes=850 * MIB, budget_bytes=GIB) is None
    )
    over = verify_peak(measured_bytes=GIB + MIB, predicted_bytes=900 * MIB, budget_bytes=GIB)
    assert over is not None and "exceeds the budget" in over
    wrong = verify_peak(measured_bytes=900 * MIB, predicted_bytes=400 * MIB, budget_bytes=GIB)
    assert wrong is not None and "predictions do not hold" in wrong


# -- reuse ------------------------------------------------------------------------------------

ARGS = ServerArgs(model=MODEL_PRESETS["micro-video"])


def fp(args: ServerArgs = ARGS, **changes: str | int):  # type: ignore[no-untyped-def]
    made = fingerprint(
        args,
        device="cpu (2 cores)",
        total_bytes=16 * GIB,
        torch_version="2.13.0",
        lifecycle="0.1.0",
    )
    return dataclasses.replace(made, **changes)


PLAN = plan_residency(given_budget(20 * GIB))


def stored(run_id: str, status: PlanStatus, **changes: str | int) -> StoredPlan:
    return StoredPlan(
        run_id=run_id, fingerprint=fp(**changes), plan=PLAN, status=status, note="too big"
    )


def test_verification_holds_a_request_time_to_its_prediction_with_a_stated_margin() -> None:
    """A re-warm up to three times its predicted time plus five seconds verifies (a loaded
    machine's noise on a short request); one slower than that fails, saying both times."""
    assert verify_time(measured_s=7.9, predicted_s=1.0) is None
    slow = verify_time(measured_s=8.2, predicted_s=1.0)
    assert slow is not None and "8.20 s" in slow and "1.00 s" in slow


def test_a_verified_plan_with_the_same_fingerprint_is_reused_and_named() -> None:
    reuse = choose_reuse(fp(), [stored("r2", PlanStatus.VERIFIED)], budget_bytes=20 * GIB)
    assert reuse.stored is not None and reuse.stored.run_id == "r2"
    assert reuse.reason == "verified residency plan vae=all-frames from run r2"
    carried = dataclasses.replace(stored("r3", PlanStatus.VERIFIED), verified_in="r2")
    again = choose_reuse(fp(), [carried], budget_bytes=20 * GIB)
    assert again.stored is carried
    assert again.reason == "verified residency plan vae=all-frames from run r2"


@pytest.mark.parametrize(
    ("history", "budget", "reason"),
    [
        ([], 20 * GIB, "no residency plan for micro-video yet"),
        (
            [stored("r3", PlanStatus.ROLLED_BACK), stored("r2", PlanStatus.VERIFIED)],
            20 * GIB,
            "plan vae=all-frames rolled back in run r3 (too big); it is not reused",
        ),
        (
            [stored("r2", PlanStatus.PLANNED)],
            20 * GIB,
            "plan vae=all-frames from run r2 never verified",
        ),
        (
            [stored("r2", PlanStatus.VERIFIED, budget="123456789")],
            20 * GIB,
            "no plan for this fingerprint: the newest for micro-video (run r2) differs in budget",
        ),
        (
            [stored("r2", PlanStatus.VERIFIED, lifecycle="0.2.0")],
            20 * GIB,
            "plan vae=all-frames from run r2 was made by lifecycle 0.2.0, newer than this 0.1.0",
        ),
        (
            [stored("r2", PlanStatus.VERIFIED, torch="2.14.0", total_bytes=8 * GIB)],
            20 * GIB,
            "no plan for this fingerprint: the newest for micro-video (run r2) differs in"
            " total_bytes, torch",
        ),
        ([stored("r2", PlanStatus.VERIFIED)], 2 * GIB, "more than the budget of 2.00 GiB now"),
    ],
    ids=["none", "rolled-back", "never-verified", "budget", "newer", "device-torch", "shrunk"],
)
def test_a_plan_is_not_reused_when_the_rules_say_no_and_the_reason_says_why(
    history: list[StoredPlan], budget: int, reason: str
) -> None:
    reuse = choose_reuse(fp(), history, budget_bytes=budget)
    assert reuse.stored is None
    assert reason in reuse.reason


def test_the_fingerprint_covers_model_shape_layout_and_budget() -> None:
    base = fp()
    assert fp(ServerArgs(model=MODEL_PRESETS["tiny-video"])).differences(base) == (
        "model", "model_config", "default_shape",
    )  # fmt: skip
    two = ServerArgs(model=MODEL_PRESETS["micro-video"], num_ranks=2, ulysses=2)
    assert fp(two).differences(base) == ("layout",)
    budgeted = ServerArgs(model=MODEL_PRESETS["micro-video"], memory_budget_bytes=GIB)
    assert fp(budgeted).differences(base) == ("budget",)
    assert fp(budgeted).key != base.key and fp().key == base.key


# -- agreement --------------------------------------------------------------------------------


def test_ranks_reuse_a_plan_only_when_every_rank_found_the_same_one() -> None:
    r, none = RESIDENCY_GATE_INDEX, len(GATES)
    plan = reuse_token("verified residency plan x from run r1")
    other = reuse_token("verified residency plan x from run r2")
    assert agreed_gate([r, r], [plan, plan]) == (r, True)
    assert agreed_gate([r, r], [plan, other]) == (none, False)  # different plans: calibrate
    assert agreed_gate([r, none], [plan, 0]) == (none, False)  # one found none: calibrate
    assert agreed_gate([r, r], [0, plan]) == (r, False)  # planner unavailable on one rank
    assert agreed_gate([3, r], [0, plan]) == (3, False)  # an earlier gate decides
    assert reuse_token(None) == 0
    assert agreed_rollback([False, True, False, True]) == (1, 3)
    assert agreed_rollback([False, False]) == ()


# -- input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("600MiB", 600 * MIB), ("2GiB", 2 * GIB), ("1.5G", 1_500_000_000), ("4096", 4096)],
)
def test_sizes_parse(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "2 parsecs", "nan", "1e400"])
def test_bad_sizes_are_one_clear_error(text: str) -> None:
    with pytest.raises(ConfigError, match="is not a size such as 600MiB"):
        parse_size(text)


def test_a_budget_below_64_mib_is_refused() -> None:
    with pytest.raises(ConfigError, match="memory_budget_bytes must be at least 64MiB"):
        ServerArgs(memory_budget_bytes=MIB)


def test_over_budget_fires_only_in_re_warm() -> None:
    assert parse_fault("1:re-warm:over-budget").kind is FaultKind.OVER_BUDGET
    with pytest.raises(FaultSpecError, match="over-budget fires only in re-warm"):
        parse_fault("1:probe:over-budget")
