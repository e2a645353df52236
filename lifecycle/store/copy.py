"""`lifecycle db copy`: a node's journal (its black box) into the fleet's, run by run.

Each rank's events are written as its own writer wrote them (same sequence numbers, states,
times), through a RankWriter, so the copy gets its summaries and its key checks. A rank the
destination holds all of is left as it is and counted; one it holds the start of (a run that
was still being written at the last copy) is completed from where it ends.
"""

from __future__ import annotations

from dataclasses import dataclass

from lifecycle.core.errors import JournalConflict
from lifecycle.core.events import Event, UnknownEvent
from lifecycle.store.journal import Journal

COPY_BATCH = 1000  # events a transaction


@dataclass
class Copied:
    runs: int = 0
    ranks: int = 0
    events: int = 0
    present: int = 0  # ranks the destination held whole already
    completed: int = 0  # ranks it held the start of, completed
    undecodable: int = 0  # rows of kinds this lifecycle cannot write back (left out)

    def line(self, source: str, destination: str) -> str:
        text = (
            f"{source} -> {destination}: copied {self.events:,} events of {self.ranks} rank(s)"
            f" in {self.runs} run(s)"
        )
        if self.completed:
            text += f" ({self.completed} of them completed from where an earlier copy ended)"
        if self.present:
            text += f"; {self.present} rank(s) already there, left as they are"
        if self.undecodable:
            text += f"; {self.undecodable} undecodable row(s) left out"
        return text


def copy_journal(source: Journal, destination: Journal, *, run_ids: set[str] | None) -> Copied:
    """Copy every run of `source` (or those in `run_ids`) into `destination`."""
    done = Copied()
    for run in source.runs():
        if run_ids is not None and run.run_id not in run_ids:
            continue
        destination.create_run(run)
        copied_any = False
        for rank in source.ranks(run.run_id):
            have = destination.last_seq(run.run_id, rank)
            if have is not None and have >= (source.last_seq(run.run_id, rank) or -1):
                done.present += 1
                continue
            try:
                writer = destination.writer(run_id=run.run_id, rank=rank, resume=have is not None)
            except JournalConflict:
                done.present += 1  # another copy or writer took it meanwhile
                continue
            try:
                batch: list[tuple[Event, str, float, int]] = []
                start = 0 if have is None else have + 1
                for stored in source.read(run_id=run.run_id, rank=rank, from_seq=start):
                    if isinstance(stored.event, UnknownEvent):
                        done.undecodable += 1
                        continue
                    batch.append((stored.event, stored.state, stored.wall_time, stored.mono_ns))
                    if len(batch) == COPY_BATCH:
                        done.events += len(writer.append_batch(batch))
                        batch = []
                if batch:
                    done.events += len(writer.append_batch(batch))
            finally:
                writer.close()
            done.ranks += 1
            done.completed += have is not None
            copied_any = True
        done.runs += copied_any
    return done
