"""Hand-built startups that more than one verdict test writes into a journal."""

from __future__ import annotations

from dataclasses import replace

from lifecycle.core.format.events import Aborted, ActionFinished, ActionStarted, Error, Shutdown
from lifecycle.testing.journals import JournalBuilder, RankStream, a2a, beat, timeout_error

# Every startup state a rank walks through before ready, after created.
BEFORE_READY = ("gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers")


def warming(b: JournalBuilder, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Each of `ranks` walks from created into bounded-warm."""
    for rank in ranks:
        b.rank(rank).walk(0.1, "gate-check", "bounded-warm")


def walked_to_ready(stream: RankStream) -> None:
    """The rank walks from created into ready, and its ready action runs (done at 1.1 s)."""
    stream.walk(0.1, "gate-check", "bounded-warm", "ready")
    stream.add(1.0, ActionStarted(action="mark-ready"))
    stream.add(1.1, ActionFinished(action="mark-ready", duration_s=0.1, ok=True))


def signalled(events_written: int = 10) -> Shutdown:
    """The shutdown of a rank stopped by SIGTERM."""
    return Shutdown(
        reason="signal", signal="SIGTERM", events_written=events_written, journal_write_s=0.01
    )


def hung_then_stopped(b: JournalBuilder) -> None:
    """Rank 0 waits 20 s in ulysses0 #0, which rank 1 never enters, while both heartbeat;
    then SIGTERM stops both."""
    warming(b)
    b.rank(0).add(1.0, a2a("ulysses0", 0))
    for t in range(2, 21):
        b.rank(0).add(t, beat(a2a("ulysses0", 0)))
        b.rank(1).add(t, beat())
    for rank in (0, 1):
        b.rank(rank).add(21.0, signalled())


def error(
    kind: str, message: str, error_type: str = "CollectiveError", *, fatal: bool = True
) -> Error:
    return Error(error_type=error_type, error_kind=kind, message=message, traceback="",
                 trigger=None, fatal=fatal)  # fmt: skip


def aborted(*, by: int, error_type: str, kind: str, message: str, state: str) -> Aborted:
    """What a rank journals when the agreed abort stops it for rank `by`'s failure."""
    return Aborted(failed_rank=by, error_type=error_type, error_kind=kind, message=message,
                   failed_state=state, announced_by="rank", learned_after_s=0.2)  # fmt: skip


def aborted_by_a_peer(b: JournalBuilder) -> None:
    """Rank 1 raises in bounded-warm; rank 0, waiting in ulysses0 #0, learns it through the
    agreed abort and stops."""
    warming(b)
    b.rank(0).add(1.0, a2a("ulysses0", 0))
    b.rank(1).add(1.1, error("injected", "raised in bounded-warm", error_type="InjectedFault"))
    b.rank(1).walk(1.2, "failed")
    b.rank(0).add(1.4, Aborted(failed_rank=1, error_type="InjectedFault", error_kind="injected",
                               message="raised in bounded-warm", failed_state="bounded-warm",
                               announced_by="rank", learned_after_s=0.3))  # fmt: skip
    b.rank(0).walk(1.5, "failed")


def hung_in_drop_buffers(b: JournalBuilder) -> None:
    """Four ranks (cfg 2 x ulysses 2); rank 2 hangs in drop-buffers, heartbeats going on,
    while the others go on to ready and its first all-to-alls: rank 3 waits for rank 2 in
    ulysses1 #0 until its 5 s timeout and fails, rank 0 waits for rank 2 in cfg0 #0 and rank 1
    for rank 3 in cfg1 #0, and the agreed abort of rank 3's failure stops ranks 0, 1 and 2
    (as `boot --num-ranks 4 --cfg-parallel 2 --ulysses 2 --fault 2:drop-buffers:hang` does)."""
    for rank in range(4):
        b.rank(rank).walk(0.1, *BEFORE_READY)
    waits = {
        rank: replace(a2a(group, 0, ranks=members), timeout_s=5.0)
        for rank, group, members in ((0, "cfg0", (0, 2)), (1, "cfg1", (1, 3)),
                                     (3, "ulysses1", (2, 3)))
    }  # fmt: skip
    for rank, started in waits.items():
        b.rank(rank).walk(1.0, "ready")
        b.rank(rank).add(1.5, started)
    for t in range(2, 7):
        for rank in range(4):
            b.rank(rank).add(t, beat(waits.get(rank)))
    timed_out = replace(
        timeout_error("ulysses1", 0),
        message="all_to_all #0 in group ulysses1 did not finish within 5 s",
    )
    b.rank(3).add(6.5, timed_out)
    b.rank(3).walk(6.6, "failed")
    for rank in (0, 1, 2):
        b.rank(rank).add(6.8, aborted(by=3, error_type=timed_out.error_type,
                                      kind=timed_out.error_kind, message=timed_out.message,
                                      state="ready"))  # fmt: skip
        b.rank(rank).walk(6.9, "failed")
