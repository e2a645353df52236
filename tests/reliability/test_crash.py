"""Crash consistency: SIGKILL a rank at random moments; the journal always tells where it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.crash import kill_loop

pytestmark = [pytest.mark.ranks]

KILLS = 50
SEED = 20261130


def test_every_kill_leaves_an_intact_journal_that_names_the_state(tmp_path: Path) -> None:
    """50 SIGKILLs of 1- and 2-rank startups at seeded random moments: every journal passes
    integrity_check with gapless sequences, and replay diagnoses the killed rank as crashed
    in the state its journal ends in."""
    results = list(kill_loop(tmp_path, kills=KILLS, seed=SEED))
    landed = [r for r in results if r.killed]
    assert len(landed) >= KILLS
    assert {r.ranks for r in landed} == {1, 2}
    assert len({r.last_state for r in landed}) >= 3, "kills should land in several states"
    failures = [(r.index, r.ranks, r.problem) for r in results if not r.ok]
    assert failures == []
