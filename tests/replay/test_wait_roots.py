"""Who a hang is followed to under the agreed abort (docs/architecture.md)."""

from __future__ import annotations

from lifecycle.core.errors import ErrorKind
from lifecycle.verdict.culprits import wait_roots
from lifecycle.verdict.evidence import FirstError
from lifecycle.verdict.status import PendingInfo, RankVerdict, Status


def _verdict(rank: int, status: Status, **fields: object) -> RankVerdict:
    base: dict[str, object] = {
        "rank": rank, "state": "failed", "last_state": "probe", "status": status,
        "pending": None, "last_heartbeat_age_s": 0.1, "first_error": None, "faults": (),
        "stalls": 0, "stop_signal": None, "stop_reason": None,
    }  # fmt: skip
    return RankVerdict(**{**base, **fields})  # type: ignore[arg-type]


def test_a_wait_on_ranks_the_abort_stopped_is_followed_to_the_failure_that_stopped_them() -> None:
    """The field's failure on 4 ranks: rank 1 fails in probe; ranks 0 and 2 are stopped by the
    agreed abort before they reach the all-to-all rank 3 waits in. Rank 3 waited for 0, 1 and
    2, but 0 and 2 are victims of rank 1's failure, not why it waited: the root is rank 1."""
    waiting = PendingInfo(
        group="ulysses0", group_seq=39, op="all_to_all", purpose="buffer-handshake",
        since_s=16.0, waited_s=0.0, waiting_for=(0, 1, 2),
    )  # fmt: skip
    verdicts = {
        0: _verdict(0, Status.ABORTED, last_state="bounded-warm", aborted=True, aborted_by=1),
        1: _verdict(1, Status.FAILED),
        2: _verdict(2, Status.ABORTED, aborted=True, aborted_by=1),
        3: _verdict(3, Status.BLOCKED, pending=waiting, aborted=True, aborted_by=1),
    }
    assert wait_roots(verdicts, missing=()) == [1]
    # A rank the abort stopped with no failed rank named (the store went away) is still
    # where the wait ends.
    verdicts[0] = _verdict(0, Status.ABORTED, aborted=True, aborted_by=None)
    assert sorted(wait_roots(verdicts, missing=())) == [0, 1]


def test_a_rank_aborted_by_the_timeout_of_the_rank_waiting_for_it_is_the_root() -> None:
    """Rank 1 hangs silently; rank 0's wait for it times out, and that failure aborts rank 1.
    Rank 1 is what rank 0 waited for: the root, although the abort stopped it."""
    timed_out = PendingInfo(
        group="world", group_seq=0, op="all_reduce", purpose="gate-agree", since_s=30.0,
        waited_s=8.0, waiting_for=(1,),
    )  # fmt: skip
    error = FirstError(
        rank=0, at_s=38.0, state="gate-check", error_type="CollectiveTimeout",
        kind=ErrorKind.COLLECTIVE_TIMEOUT, message="did not finish within 8 s",
    )  # fmt: skip
    verdicts = {
        0: _verdict(
            0, Status.FAILED, last_state="gate-check", pending=timed_out, first_error=error
        ),
        1: _verdict(1, Status.ABORTED, last_state="gate-check", aborted=True, aborted_by=0),
    }
    assert wait_roots(verdicts, missing=()) == [1]
