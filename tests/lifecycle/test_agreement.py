"""The rules ranks agree on: one pure function each, shared by the live path and verify."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lifecycle.core.decisions.agreement import (
    agreed_decision,
    agreed_probe_shape,
    first_failed_gate,
)
from lifecycle.core.decisions.gates import GATES
from lifecycle.core.format.records import GateOutcome, Shape

shapes = st.builds(
    Shape,
    width=st.integers(16, 4096),
    height=st.integers(16, 4096),
    frames=st.integers(1, 257),
)


def test_the_first_failing_gate_is_the_index_of_the_first_failure() -> None:
    """All passing gives len(GATES); otherwise the index of the first gate that failed."""
    passing = [GateOutcome(name=g.name, passed=True, reason=g.reason) for g in GATES]
    assert first_failed_gate(passing) == len(GATES)
    failing = list(passing)
    failing[3] = GateOutcome(name=GATES[3].name, passed=False, reason=GATES[3].reason)
    failing[7] = GateOutcome(name=GATES[7].name, passed=False, reason=GATES[7].reason)
    assert first_failed_gate(failing) == 3


@given(st.lists(st.integers(0, len(GATES)), min_size=1, max_size=64))
def test_the_agreed_skip_reason_is_the_earliest_failure_of_any_rank(first: list[int]) -> None:
    """Any rank closing calibration closes it for all, with the earliest gate's reason, and
    the order the ranks report in does not matter (no rank found a plan to reuse)."""

    def agreed_skip_reason(first_failed: list[int]) -> str | None:
        reason, reused = agreed_decision(first_failed, [0] * len(first_failed), None)
        assert not reused
        return reason

    reason = agreed_skip_reason(first)
    assert reason == agreed_skip_reason(list(reversed(first)))
    if all(i == len(GATES) for i in first):
        assert reason is None
    else:
        assert reason == GATES[min(first)].reason


@given(st.lists(shapes, min_size=1, max_size=16), st.randoms())
def test_the_agreed_probe_is_the_smallest_whatever_the_order(
    fitted: list[Shape], rng: object
) -> None:
    """Every rank computes the same probe from the same set of fits, in any order, and it
    is no larger in pixels than any rank's own fit."""
    shuffled = list(fitted)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    agreed = agreed_probe_shape(fitted)
    assert agreed == agreed_probe_shape(shuffled)
    assert agreed in fitted
    assert all(agreed.pixels <= s.pixels for s in fitted)  # type: ignore[union-attr]


@given(st.lists(shapes, max_size=8))
def test_one_rank_without_a_fit_means_no_probe(fitted: list[Shape]) -> None:
    """A rank that fitted no probe closes the probe for everyone."""
    assert agreed_probe_shape([*fitted, None]) is None
