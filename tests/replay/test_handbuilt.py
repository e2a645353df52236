"""Diagnoses of hand-built journals: mismatches, missing members, crashes, cut-off journals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lifecycle.core.format.events import ActionStarted, Error, Shutdown
from lifecycle.testing.journals import AS_WRITTEN, JournalBuilder, a2a, beat, done, timeout_error
from replay.cli import main
from tests.replay.scenarios import signalled, walked_to_ready, warming


def diagnose(db: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:  # type: ignore[type-arg]
    status = main(["diagnose", "latest", str(db), "--json", *AS_WRITTEN])
    return status, json.loads(capsys.readouterr().out)


def verdict(status: int, doc: dict) -> tuple[object, ...]:  # type: ignore[type-arg]
    """The exit status, the outcome, the culprit ranks and the state they were in."""
    return (status, doc["outcome"], doc["culprit_ranks"], doc["culprit_state"])


def ranks_by_number(doc: dict) -> dict[int, dict]:  # type: ignore[type-arg]
    return {r["rank"]: r for r in doc["ranks"]}


def failed_in_gate_check(db: Path, *, error_type: str, message: str) -> None:
    """A one-rank journal whose rank raises `error_type` (no collective) in gate-check and
    fails."""
    b = JournalBuilder(db, world_size=1)
    s = b.rank(0)
    s.walk(0.1, "gate-check")
    s.add(0.5, Error(error_type=error_type, error_kind="exception", message=message,
                     traceback="", trigger=None, fatal=True))  # fmt: skip
    s.walk(0.6, "failed")
    b.close()


def test_a_size_mismatch_at_the_same_sequence_number_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks in all-to-all #3 with different shapes: the mismatch names the group, the
    sequence number and both signatures."""
    b = JournalBuilder(tmp_path / "j.db")
    warming(b)
    for seq in range(3):
        for rank in (0, 1):
            b.rank(rank).add(1 + seq, a2a("ulysses0", seq))
            b.rank(rank).add(1.01 + seq, done("ulysses0", seq))
    b.rank(0).add(5, a2a("ulysses0", 3, shape=(2, 8)))
    b.rank(1).add(5, a2a("ulysses0", 3, shape=(2, 16)))
    for rank in (0, 1):
        for t in range(6, 10):
            b.rank(rank).add(t, beat())
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert status == 1
    assert doc["outcome"] == "hung"
    (mismatch,) = doc["mismatches"]
    assert (mismatch["group"], mismatch["group_seq"]) == ("ulysses0", 3)
    assert mismatch["reason"] == "different types or shapes"
    assert "2x16" in mismatch["by_rank"]["1"] and "2x8" in mismatch["by_rank"]["0"]


def test_all_to_all_split_sizes_that_do_not_pair_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 0 sends 8 elements to rank 1, which expects 6 from it: a split mismatch."""
    b = JournalBuilder(tmp_path / "j.db")
    warming(b)
    b.rank(0).add(1, a2a("ulysses0", 0, splits=(8, 8), out_splits=(8, 8)))
    b.rank(1).add(1, a2a("ulysses0", 0, splits=(8, 8), out_splits=(6, 8)))
    for rank in (0, 1):
        for t in range(2, 6):
            b.rank(rank).add(t, beat())
    b.close()
    _, doc = diagnose(tmp_path / "j.db", capsys)
    (mismatch,) = doc["mismatches"]
    assert mismatch["reason"] == "rank 0 sends 8 elements to rank 1, which expects 6"


def test_the_rank_missing_from_a_collective_the_others_entered_is_the_culprit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ranks 0, 2, 3 wait in world #1 that rank 1 never entered; rank 1 is alive (heartbeats)
    and stuck in bounded-warm: it is the culprit, the others wait for it."""
    b = JournalBuilder(tmp_path / "j.db", world_size=4)
    members = (0, 1, 2, 3)
    for rank in members:
        b.rank(rank).walk(0.1, "gate-check", "bounded-warm")
        b.rank(rank).add(1, a2a("world", 0, ranks=members, splits=(2, 2, 2, 2)))
        b.rank(rank).add(1.1, done("world", 0))
    for rank in (0, 2, 3):
        b.rank(rank).add(2, a2a("world", 1, ranks=members, splits=(2, 2, 2, 2)))
    for rank in members:
        for t in range(3, 12):
            b.rank(rank).add(t, beat())
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert verdict(status, doc) == (1, "hung", [1], "bounded-warm")
    ranks = ranks_by_number(doc)
    assert ranks[1]["status"] == "hung"
    for rank in (0, 2, 3):
        assert ranks[rank]["status"] == "blocked"
        assert ranks[rank]["pending_collective"]["waiting_for"] == [1]
    world = next(g for g in doc["groups"] if g["group"] == "world")
    assert world["started"] == {"0": 1, "1": 0, "2": 1, "3": 1}
    assert world["finished"] == {"0": 0, "1": 0, "2": 0, "3": 0}


def test_a_rank_whose_journal_stops_while_the_others_go_on_crashed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No heartbeat after rank 1's last event while rank 0 heartbeats on: a crash, told
    apart from a hang by the heartbeats."""
    b = JournalBuilder(tmp_path / "j.db")
    warming(b)
    b.rank(1).add(1.0, ActionStarted(action="bounded-warmup"))
    b.rank(0).add(1.0, a2a("ulysses0", 0))
    for t in range(2, 12):
        b.rank(0).add(t, beat(a2a("ulysses0", 0)))
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert verdict(status, doc) == (1, "crashed", [1], "bounded-warm")
    ranks = ranks_by_number(doc)
    assert ranks[1]["status"] == "crashed"
    assert ranks[1]["last_heartbeat_age_s"] is None
    assert ranks[0]["last_heartbeat_age_s"] == pytest.approx(0.0)


def test_the_state_column_is_where_each_journal_ends_after_a_crash_in_ready(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 dies in ready and the server then stops rank 0: diagnose says rank 0's journal
    ends `stopped` (after ready), as `show` does, and rank 1's in `ready`, where it crashed."""
    b = JournalBuilder(tmp_path / "j.db")
    for rank in (0, 1):
        b.rank(rank).walk(0.1, "gate-check", "bounded-warm", "ready")
        b.rank(rank).add(1.0, beat())
    for t in range(2, 8):
        b.rank(0).add(t, beat())
    b.rank(0).add(8.0, Shutdown(reason="server failed", signal=None, events_written=12,
                                journal_write_s=0.01))  # fmt: skip
    b.rank(0).walk(8.01, "stopped")
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert verdict(status, doc) == (1, "crashed", [1], "ready")
    ranks = ranks_by_number(doc)
    assert (ranks[0]["state"], ranks[0]["last_state"]) == ("stopped", "ready")
    assert (ranks[1]["state"], ranks[1]["last_state"], ranks[1]["status"]) == (
        "ready",
        "ready",
        "crashed",
    )
    assert main(["diagnose", "latest", str(tmp_path / "j.db"), *AS_WRITTEN]) == 1
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    row = rows[[r[:1] for r in rows].index(["0"])]
    assert row[:5] == ["0", "ready", "->", "stopped", "stopped"]


def test_a_late_rank_is_named_when_nobody_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 gave up on ulysses0 #4 at its timeout; rank 0 entered #4 only afterwards and then
    waited in #5: rank 0 came late and is the culprit."""
    b = JournalBuilder(tmp_path / "j.db")
    warming(b)
    b.rank(1).add(1.0, a2a("ulysses0", 4))
    b.rank(1).add(3.0, timeout_error("ulysses0", 4))
    b.rank(0).add(3.5, a2a("ulysses0", 4))
    b.rank(0).add(3.6, done("ulysses0", 4))
    b.rank(0).add(3.7, a2a("ulysses0", 5))
    b.rank(0).add(5.7, timeout_error("ulysses0", 5))
    b.close()
    _, doc = diagnose(tmp_path / "j.db", capsys)
    assert doc["outcome"] == "hung"
    assert doc["culprit_ranks"] == [0]
    assert "rank 0 came late to ulysses0 #4" in doc["summary"]
    assert doc["first_error"]["rank"] == 1


def test_a_clean_run_is_ready_and_exits_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank through ready with its ready action done and stopped: outcome ready."""
    b = JournalBuilder(tmp_path / "j.db")
    for rank in (0, 1):
        s = b.rank(rank)
        walked_to_ready(s)
        s.add(
            1.2,
            Shutdown(reason="boot complete", signal=None, events_written=7, journal_write_s=0.001),
        )
        s.walk(1.3, "stopped")
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (0, "ready", [])


def test_a_plain_error_is_failed_with_its_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rank raising (no collective involved) is outcome failed, culprit that rank."""
    failed_in_gate_check(tmp_path / "j.db", error_type="OutOfMemoryError",
                         message="CUDA out of memory")  # fmt: skip
    status, doc = diagnose(tmp_path / "j.db", capsys)
    assert verdict(status, doc) == (1, "failed", [0], "gate-check")
    assert doc["first_error"]["type"] == "OutOfMemoryError"


def test_control_sequences_in_journal_text_are_not_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error message carrying terminal escape sequences is shown without them."""
    failed_in_gate_check(tmp_path / "j.db", error_type="Boom\x1b]0;pwned\x07",
                         message="\x1b[31mred\x1b[0m\x1b[2J text")  # fmt: skip
    for command in (["diagnose", "latest"], ["show", "latest"]):
        main([*command, str(tmp_path / "j.db")])
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out
        assert "red text" in out


@pytest.mark.parametrize(("ends_at", "expected"), [(11.6, "hung"), (5.0, "crashed")])
def test_a_rank_ended_as_its_collective_timed_out_waited_and_did_not_go_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ends_at: float, expected: str
) -> None:
    """Rank 0 waits in world #1 (timeout 10 s), which rank 1 never enters; rank 0's journal
    ends with no error of its own. Ending as the timeout runs out is NCCL's watchdog ending
    the process: rank 0 was blocked, rank 1 (alive, stuck, later stopped) is the culprit.
    Ending long before the timeout is a crash of rank 0."""
    b = JournalBuilder(tmp_path / "j.db")
    warming(b)
    for rank in (0, 1):
        b.rank(rank).add(1.0, a2a("world", 0))
        b.rank(rank).add(1.1, done("world", 0))
    waiting = dataclasses.replace(a2a("world", 1), timeout_s=10.0)
    b.rank(0).add(2.0, waiting)
    for t in range(3, 21):
        if t < ends_at:
            b.rank(0).add(t, beat(waiting))
        b.rank(1).add(t, beat())
    b.rank(1).add(20.5, signalled())
    b.close()
    status, doc = diagnose(tmp_path / "j.db", capsys)
    ranks = ranks_by_number(doc)
    if expected == "crashed":
        assert verdict(status, doc) == (1, "crashed", [0], "bounded-warm")
        assert ranks[0]["status"] == "crashed"
        return
    assert verdict(status, doc) == (1, "hung", [1], "bounded-warm")
    assert ranks[0]["status"] == "blocked"
    codes = {(e["code"], e["rank"]) for e in doc["evidence"] if "rank" in e}
    assert ("ended-at-timeout", 0) in codes
    blocked = next(e for e in doc["evidence"] if e["code"] == "blocked")
    assert (blocked["rank"], blocked["ended"], blocked["waiting_for"]) == (0, "timed-out", [1])
    assert "NCCL's watchdog" in doc["summary"] or "timed out after" in doc["summary"]
