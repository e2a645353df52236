"""Crash consistency: SIGKILL a rank at random moments; the journal always tells where it was."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from bench.crash import kill_loop
from tests.conftest import run_cli

pytestmark = [pytest.mark.ranks]

KILLS = 20
SEED = 20261130


def journal_facts(db: Path, rank: int) -> tuple[str, bool, str | None]:
    """What the file itself says: integrity_check, whether every rank's seq is gapless, and
    the state of the killed rank's last row."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        integrity = str(conn.execute("PRAGMA integrity_check").fetchone()[0])
        gaps = conn.execute(
            "SELECT count(*) FROM (SELECT rank, max(seq) + 1 - count(*) AS missing"
            " FROM events GROUP BY run_id, rank) WHERE missing != 0"
        ).fetchone()[0]
        last = conn.execute(
            "SELECT state FROM events WHERE rank = ? ORDER BY seq DESC LIMIT 1", (rank,)
        ).fetchone()
    return integrity, gaps == 0, last[0] if last else None


@pytest.mark.slow
def test_every_kill_leaves_an_intact_journal_that_names_the_state(tmp_path: Path) -> None:
    """20 SIGKILLs of 1- and 2-rank startups at seeded random moments (in a state drawn at
    random, then up to half a second in): every journal passes
    integrity_check with gapless sequences, and `replay diagnose` says crashed, names the
    killed rank, and places it in the state its journal ends in."""
    landed = [r for r in kill_loop(tmp_path, kills=KILLS, seed=SEED) if r.killed]
    assert len(landed) >= KILLS
    assert {r.ranks for r in landed} == {1, 2}
    problems = []
    states = set()
    for result in landed:
        integrity, gapless, last_state = journal_facts(result.db, result.victim)
        states.add(last_state)
        verdict = run_cli(
            "replay", ["diagnose", "latest", str(result.db), "--json"], cwd=result.db.parent
        )
        doc = json.loads(verdict.stdout)
        victim = next(r for r in doc["ranks"] if r["rank"] == result.victim)
        seen = (integrity, gapless, doc["outcome"], doc["culprit_ranks"][:1], victim["last_state"])
        if seen != ("ok", True, "crashed", [result.victim], last_state):
            problems.append((result.index, result.ranks, seen, doc["summary"][:200]))
    assert problems == []
    assert len(states) >= 3, f"kills should land in several states, not only {states}"
