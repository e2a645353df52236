"""What `replay diagnose` says of the ranks a culprit stopped: a raise its peers learned of at
once is a failure, not a hang; a first error journaled by a victim says so; a run whose ranks
journaled nothing reads without an empty list."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder
from replay.cli import main
from tests.replay.scenarios import aborted_by_a_peer, hung_in_drop_buffers


def diagnosed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], build: object, *, world_size: int = 2
) -> tuple[dict, str]:  # type: ignore[type-arg]
    """The JSON and the text `replay diagnose` prints of a journal `build` writes."""
    b = JournalBuilder(tmp_path / "j.db", world_size=world_size)
    build(b)  # type: ignore[operator]
    b.close()
    args = ["diagnose", "latest", str(tmp_path / "j.db"), *AS_WRITTEN]
    main([*args, "--json"])
    doc = json.loads(capsys.readouterr().out)
    main(args)
    return doc, capsys.readouterr().out


def test_a_raise_its_peer_learned_of_at_once_is_a_failure_not_a_hang(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 raises as rank 0 enters a collective with it, and the agreed abort stops rank 0
    0.4 s into its wait: the run failed in rank 1's raise; rank 0 was aborted, not blocked,
    and no wait is said to have been aborted after a fraction of a second."""
    doc, text = diagnosed(tmp_path, capsys, aborted_by_a_peer)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "failed", [1], "bounded-warm",
    ), doc["summary"]  # fmt: skip
    assert [r["status"] for r in doc["ranks"]] == ["aborted", "failed"]
    assert doc["summary"].startswith("failed: rank 1 failed first, in bounded-warm"), doc["summary"]
    assert "then aborted: rank 0 in bounded-warm" in doc["summary"]
    assert "hung" not in text and "aborted after" not in text, text
    assert not [e for e in doc["evidence"] if e["code"] == "blocked"]


def test_a_wait_the_abort_ended_after_a_hang_is_still_followed_to_the_rank_that_hung(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Four ranks, rank 2 hung in drop-buffers: rank 0 waited 5 s for it before the abort of
    rank 3's timeout stopped it, and the verdict still follows that wait: hung, rank 2 in
    drop-buffers, rank 0 blocked there with its wait ended `aborted`."""
    doc, _ = diagnosed(tmp_path, capsys, hung_in_drop_buffers, world_size=4)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "hung", [2], "drop-buffers",
    ), doc["summary"]  # fmt: skip
    assert [r["status"] for r in doc["ranks"]] == ["blocked", "blocked", "hung", "failed"]
    waits = {e["rank"]: (e["waiting_for"], e["ended"]) for e in doc["evidence"]
             if e["code"] == "blocked"}  # fmt: skip
    assert waits == {0: ([2], "aborted"), 1: ([3], "aborted"), 3: ([2], "timed-out")}


def test_a_first_error_journaled_by_a_victim_says_whose_victim_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 2 hung and journaled no error; the first error is rank 3's timeout waiting for
    it: the first-error line names rank 3's error as a victim's of rank 2, the culprit."""
    doc, text = diagnosed(tmp_path, capsys, hung_in_drop_buffers, world_size=4)
    lines = text.splitlines()
    assert lines[1] == "culprit: rank 2 in drop-buffers", text
    assert lines[2] == (
        "first error: rank 3 in ready at +6.50 s, a victim of rank 2: CollectiveTimeout:"
        " all_to_all #0 in group ulysses1 did not finish within 5 s"
    ), text
    assert doc["first_error"]["rank"] == 3  # the JSON is as it was


def test_a_culprits_own_first_error_is_not_called_a_victims(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """When the first error is the culprit's own, the first-error line says nothing more."""
    _, text = diagnosed(tmp_path, capsys, aborted_by_a_peer)
    (line,) = [line for line in text.splitlines() if line.startswith("first error:")]
    assert line == (
        "first error: rank 1 in bounded-warm at +1.10 s: InjectedFault: raised in bounded-warm"
    )


def test_ranks_that_journaled_nothing_leave_no_empty_clause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run whose ranks were killed before their journals opened (the launcher recorded the
    run, no rank an event) is incomplete, and says so without an empty list of ranks."""
    doc, text = diagnosed(tmp_path, capsys, lambda b: None)
    assert doc["outcome"] == "incomplete"
    assert (
        doc["summary"] == "incomplete: the journal ends before a verdict; no journal for rank 0, 1"
    )
    assert ": ;" not in text and "absent: no events from rank 0, 1" in text
