"""How a culprit still in a collective is named: hung there when its peers are in the same
collective, out of step only when it went on past them (docs/architecture.md). Hand-built journals,
read the way `replay diagnose` reads them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from lifecycle.testing.journals import JournalBuilder, a2a, beat, done, timeout_error
from lifecycle.verdict.headline import Wrong, named_culprits
from lifecycle.verdict.launched import culprit_error
from replay.load import Journals
from replay.verdict.analysis import combine
from replay.verdict.diagnose import Diagnosis, diagnose
from tests.replay.scenarios import warming


def rank_1_waits_in(db: Path, seq: int) -> Diagnosis:
    """Ranks 0 and 1 finish ulysses0 #0-#2; rank 0 then waits in #3 until it times out, while
    rank 1, its heartbeats going on, waits in #`seq` (after an all-gather #3 of its own when
    `seq` is 4). The verdict, with rank 1 taken for the culprit as a server's liveness names
    it (its process frozen)."""
    b = JournalBuilder(db)
    warming(b)
    for n in range(3):
        for rank in (0, 1):
            b.rank(rank).add(1 + n, a2a("ulysses0", n))
            b.rank(rank).add(1.01 + n, done("ulysses0", n))
    b.rank(0).add(5, a2a("ulysses0", 3))
    if seq == 4:
        b.rank(1).add(4.5, a2a("ulysses0", 3, op="all_gather"))
        b.rank(1).add(4.6, done("ulysses0", 3, op="all_gather"))
    b.rank(1).add(5, a2a("ulysses0", seq))
    for t in range(6, 30):
        b.rank(0).add(t, beat(a2a("ulysses0", 3)))
        b.rank(1).add(t, beat(a2a("ulysses0", seq)))
    b.rank(0).add(30, timeout_error("ulysses0", 3))
    b.rank(0).walk(30.1, "failed")
    b.close()
    with Journals.open([str(db)]) as journals:
        (run,) = journals.runs()
        d = diagnose(combine(run, journals.views(run)))
    return dataclasses.replace(d, culprit_ranks=(1,))


def test_a_culprit_in_the_collective_its_peer_timed_out_in_hung_there(tmp_path: Path) -> None:
    """Frozen inside all_to_all #3, the collective rank 0 gave up in: it hung there; it did
    not go out of step, and the failed request's answer says where it is."""
    (culprit,) = named_culprits(rank_1_waits_in(tmp_path / "j.db", 3))
    assert culprit.wrong is Wrong.HUNG
    assert culprit_error(culprit, [None, None]) == (
        "hung in bounded-warm: inside all_to_all #3 of ulysses0, which its peers entered too"
    )


def test_a_culprit_past_the_collective_its_peer_waits_in_went_out_of_step(tmp_path: Path) -> None:
    """After an all-gather at #3 where rank 0 runs an all-to-all, rank 1 waits in #4: it went
    out of step with its peers."""
    (culprit,) = named_culprits(rank_1_waits_in(tmp_path / "j.db", 4))
    assert culprit.wrong is Wrong.OUT_OF_STEP
    assert culprit_error(culprit, [None, None]) == "went out of step with its peers in bounded-warm"
