"""Many processes appending at once: nothing lost, no gap, no lock error reaching the caller."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from lifecycle.core.format.events import Heartbeat
from lifecycle.core.format.records import PendingCollective
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow

WRITERS = 8
SECONDS = 2.0


def append_for(location: str, run_id: str, rank: int, seconds: float) -> tuple[int, list[str]]:
    """Append as fast as possible for `seconds`; return how many appends returned, and any
    error that reached this caller."""
    journal = Journal.open_for_write(location)
    writer = journal.writer(run_id=run_id, rank=rank)
    pending = PendingCollective(
        group="world", group_seq=0, op="all_reduce", purpose="x", waiting_s=0
    )
    appended, errors = 0, []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            writer.append(
                Heartbeat(uptime_s=float(appended), in_state_s=0.0, pending=pending),
                state="bounded-warm",
                wall_time=time.time(),
                mono_ns=time.monotonic_ns(),
            )
            appended += 1
        except Exception as exc:  # counted, not hidden: the test asserts there are none
            errors.append(f"{type(exc).__name__}: {exc}")
    writer.close()
    journal.close()
    return appended, errors


def new_run(location: str, run_id: str) -> None:
    journal = Journal.open_for_write(location)
    journal.create_run(
        RunRow(run_id=run_id, created_at=time.time(), host="h", world_size=WRITERS, config={},
               lifecycle_version="0.1.0")
    )  # fmt: skip
    journal.close()


@pytest.mark.parametrize("layout", ["one-file", "file-per-rank"])
def test_eight_writers_lose_nothing(tmp_path: Path, layout: str) -> None:
    """8 processes appending for a bounded time, to one file or to one file each: every
    append that returned is read back, sequences are gapless, no lock error surfaced."""
    locations = [
        str(tmp_path / ("j.db" if layout == "one-file" else f"rank{r}.db")) for r in range(WRITERS)
    ]
    for location in dict.fromkeys(locations):
        new_run(location, "concurrent")
    context = multiprocessing.get_context("spawn")
    with context.Pool(WRITERS) as pool:
        results = pool.starmap(
            append_for, [(locations[r], "concurrent", r, SECONDS) for r in range(WRITERS)]
        )
    assert [errors for _, errors in results] == [[] for _ in range(WRITERS)]
    for rank, (appended, _) in enumerate(results):
        assert appended > 0
        reader = Journal.open_for_read(locations[rank])
        seqs = [e.seq for e in reader.read(run_id="concurrent", rank=rank)]
        reader.close()
        assert seqs == list(range(appended)), f"rank {rank}: lost or extra events"
