"""Hand-built startups that more than one verdict test writes into a journal."""

from __future__ import annotations

from lifecycle.core.events import Shutdown
from tests.replay.builder import JournalBuilder, a2a, beat


def warming(b: JournalBuilder, ranks: tuple[int, ...] = (0, 1)) -> None:
    """Each of `ranks` walks from created into bounded-warm."""
    for rank in ranks:
        b.rank(rank).walk(0.1, "gate-check", "bounded-warm")


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
