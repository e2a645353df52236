"""Open journals read-only, merge them by run id, and resolve a run reference."""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from lifecycle.errors import AmbiguousRun, JournalError, ReplayError, RunNotFound
from lifecycle.events import StoredEvent
from lifecycle.journal import Journal, RunRow


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo:
    """One run as recorded in one or more journals."""

    run_id: str
    created_at: float
    host: str
    world_size: int
    config: dict[str, Any]
    lifecycle_version: str
    command: str | None
    sources: tuple[str, ...]


@dataclass
class Journals:
    """Every journal given on the command line, opened read-only.

    A journal that cannot be read is reported in `problems` (one line each) and left out; the
    others are still read.
    """

    sources: list[Journal] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, locations: Sequence[str]) -> Journals:
        opened = cls()
        for location in locations:
            try:
                opened.sources.append(Journal.open_for_read(location))
            except JournalError as exc:
                opened.problems.append(str(exc))
        if not opened.sources:
            raise ReplayError(
                "no usable journal" + (f": {opened.problems[0]}" if opened.problems else "")
            )
        return opened

    def close(self) -> None:
        for journal in self.sources:
            journal.close()

    def __enter__(self) -> Journals:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def runs(self) -> list[RunInfo]:
        """Every run of every journal, merged by run id, oldest first."""
        merged: dict[str, tuple[RunRow, list[str]]] = {}
        for journal in self.sources:
            try:
                rows = journal.runs()
            except JournalError as exc:
                self.problems.append(str(exc))
                continue
            for row in rows:
                if row.run_id in merged:
                    first, where = merged[row.run_id]
                    where.append(journal.location)
                    if row.config != first.config:
                        self.problems.append(
                            f"{journal.location}: run {row.run_id} has a different config than"
                            f" in {where[0]}; using the first"
                        )
                else:
                    merged[row.run_id] = (row, [journal.location])
            self.problems.extend(journal.malformed_rows)
        infos = [
            RunInfo(
                run_id=row.run_id,
                created_at=row.created_at,
                host=row.host,
                world_size=row.world_size,
                config=row.config,
                lifecycle_version=row.lifecycle_version,
                command=row.command,
                sources=tuple(where),
            )
            for row, where in merged.values()
        ]
        return sorted(infos, key=lambda r: (r.created_at, r.run_id))

    def resolve(self, ref: str) -> RunInfo:
        """A run id, a unique prefix of one, or `latest`."""
        runs = self.runs()
        if not runs:
            raise RunNotFound(ref=ref, known=0)
        if ref == "latest":
            return runs[-1]
        exact = [r for r in runs if r.run_id == ref]
        if exact:
            return exact[0]
        matches = [r for r in runs if r.run_id.startswith(ref)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise RunNotFound(ref=ref, known=len(runs))
        raise AmbiguousRun(ref=ref, candidates=[r.run_id for r in matches])

    def events(self, run: RunInfo, *, rank: int | None = None) -> Iterator[StoredEvent]:
        """The run's events, every rank's stream merged in wall-time order (each in seq order).

        Each rank is read from the first journal that has it (the same file given twice is
        read once). Merging keeps the readers' memory bounded: a collective is complete, and
        forgotten, soon after its last member started it.
        """
        streams: list[Iterator[StoredEvent]] = []
        claimed: set[int] = set()
        for journal in self.sources:
            if journal.location not in run.sources:
                continue
            try:
                ranks = journal.ranks(run.run_id)
            except JournalError as exc:
                self.problems.append(str(exc))
                continue
            for r in ranks:
                if (rank is not None and r != rank) or r in claimed:
                    continue
                claimed.add(r)
                streams.append(self._guarded(journal, run.run_id, r))
        yield from heapq.merge(*streams, key=lambda e: (e.wall_time, e.rank, e.seq))
        for journal in self.sources:
            self.problems.extend(m for m in journal.malformed_rows if m not in self.problems)

    def _guarded(self, journal: Journal, run_id: str, rank: int) -> Iterator[StoredEvent]:
        try:
            yield from journal.read(run_id=run_id, rank=rank)
        except JournalError as exc:
            self.problems.append(f"rank {rank}: {exc}")
