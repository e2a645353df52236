"""Diagnoses of a rank the group took for lost (docs/nodes.md): its peers were
aborted for it, whatever its own journal says after (a lifecycle before the store was sealed
let it journal a clean stop once resumed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.core.format.events import Aborted, Shutdown
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder
from replay.cli import main
from tests.replay.scenarios import walked_to_ready


def test_a_rank_taken_for_lost_that_then_stopped_cleanly_is_the_culprit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 aborted because the server announced rank 1 lost; rank 1, resumed, journaled a
    clean stop: the outcome is failed with rank 1 the culprit, said to be taken for lost, not a
    journal that ends before a verdict."""
    b = JournalBuilder(tmp_path / "j.db")
    for rank in (0, 1):
        walked_to_ready(b.rank(rank))
    lead = b.rank(0)
    lead.add(
        9.0,
        Aborted(
            failed_rank=1, error_type="RankLost", error_kind="peer-gone",
            message="rank 1 lost: no beat for 4.0 s (host b)", failed_state="ready",
            announced_by="server", learned_after_s=0.1,
        ),
    )  # fmt: skip
    lead.walk(9.1, "failed")
    resumed = b.rank(1)
    resumed.add(
        20.0,
        Shutdown(reason="rank 0 ended", signal=None, events_written=6, journal_write_s=0.001),
    )
    resumed.walk(20.1, "stopped")
    b.close()
    status = main(["diagnose", "latest", str(tmp_path / "j.db"), "--json", *AS_WRITTEN])
    doc = json.loads(capsys.readouterr().out)
    assert (status, doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        1, "failed", [1], "ready",
    )  # fmt: skip
    assert (
        "rank 1 was taken for lost in ready (RankLost, announced by the server)" in (doc["summary"])
    )
