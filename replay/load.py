"""Open journals read-only, merge them by run id, and resolve a run reference."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from lifecycle.core.errors import JournalError
from lifecycle.core.format.events import RunStarted, StoredEvent
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.validation import MAX_RANKS
from lifecycle.store.decode import DATA_ERRORS
from lifecycle.store.journal import Journal
from lifecycle.store.rows import RunRow
from lifecycle.store.summaries import Summary, with_latest_heartbeat
from lifecycle.verdict.analysis import config_number
from replay.exits import AmbiguousRun, ReplayError, RunNotFound


@dataclass(frozen=True, slots=True, kw_only=True)
class RunInfo(RunRow):
    """One run as recorded in one or more journals: its row, settled across them, and where
    it was found."""

    sources: tuple[str, ...]
    # What the journals disagree on about this run, said once the run is read.
    notes: tuple[str, ...] = ()

    @property
    def model_name(self) -> str:
        model = self.config.get("model")
        name = model.get("name") if isinstance(model, dict) else None
        return name if isinstance(name, str) else "?"

    def config_number(self, key: str, default: float | None) -> float | None:
        """A positive, finite number from the recorded config, else `default`."""
        return config_number(self.config, key, default)


@dataclass
class Journals:
    """Every journal given on the command line, opened read-only.

    A journal that cannot be read is reported in `problems` (one line each) and left out; the
    others are still read.
    """

    sources: list[Journal] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    _ranks: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    # Per journal (by id) whose summaries were all read at once: run id -> rank -> summary.
    _summaries: dict[int, dict[str, dict[int, Summary]]] = field(default_factory=dict)

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
        merged: dict[str, list[tuple[RunRow, Journal]]] = {}
        for journal in self.sources:
            try:
                rows = journal.runs()
            except JournalError as exc:
                self.problems.append(str(exc))
                continue
            except DATA_ERRORS as exc:
                self.problems.append(f"{journal.location}: its runs cannot be read: {exc}")
                continue
            for row in rows:
                held = merged.setdefault(row.run_id, [])
                if held and not _same_settings(row.config, held[0][0].config):
                    self.problems.append(
                        f"{journal.location}: run {row.run_id} has a different config than"
                        f" in {held[0][1].location}; using the first"
                    )
                held.append((row, journal))
            self.problems.extend(m for m in journal.malformed_rows if m not in self.problems)
        infos = [self._merge(run_id, held) for run_id, held in merged.items()]
        return sorted(infos, key=lambda r: (r.created_at, r.run_id))

    def _merge(self, run_id: str, held: list[tuple[RunRow, Journal]]) -> RunInfo:
        first = held[0][0]
        notes: list[str] = []
        starts = [row.created_at for row, _ in held if math.isfinite(row.created_at)]
        if len(starts) < len(held):
            notes.append(f"run {run_id}: a recorded start time is not a finite number")
        world = self._world_size(run_id, held, notes)
        return RunInfo(
            run_id=run_id,
            # The earliest, so that every file's events fall after it whatever the order given.
            created_at=min(starts, default=0.0),
            host=first.host,
            world_size=world,
            config=first.config,
            lifecycle_version=first.lifecycle_version,
            command=first.command,
            sources=tuple(dict.fromkeys(journal.location for _, journal in held)),
            notes=tuple(notes),
        )

    def _world_size(self, run_id: str, held: list[tuple[RunRow, Journal]], notes: list[str]) -> int:
        """The run's world size, whatever order its journals were given in.

        Where the run rows agree, hold every rank that has events, and are a world size this
        lifecycle can write, they are taken as they are. Otherwise each rank's own
        `run_started` says which world it joined, and the world most ranks agree on wins;
        without one, the smallest recorded world that holds every rank seen.
        """
        recorded = sorted({row.world_size for row, _ in held})
        present = self._present_ranks(run_id, [journal for _, journal in held])
        plausible = [w for w in recorded if 1 <= w <= MAX_RANKS]
        if len(recorded) == 1 and plausible and all(0 <= rank < recorded[0] for rank in present):
            return recorded[0]
        claims = self._started_world_sizes(run_id, present)
        votes = Counter(claims.values())
        if votes:
            top = max(votes.values())
            # A tie goes to the world the lowest rank joined: rank 0 is the one every rank
            # rendezvoused with.
            world = next(w for _, w in sorted(claims.items()) if votes[w] == top)
            reason = "as its ranks' run_started events record"
        else:
            holding = [w for w in plausible if all(0 <= rank < w for rank in present)]
            fallback = max(present, default=-1) + 1
            world = holding[0] if holding else (plausible[-1] if plausible else fallback)
            reason = "the smallest recorded one that holds every rank seen"
        if len(recorded) > 1:
            where = "; ".join(f"{row.world_size} in {journal.location}" for row, journal in held)
            notes.append(f"run {run_id}: journals disagree on its world size ({where});"
                         f" using {world}, {reason}")  # fmt: skip
        elif world != recorded[0]:
            notes.append(
                f"run {run_id}: its recorded world size {recorded[0]} does not fit its ranks;"
                f" using {world}, {reason}"
            )
        return world

    def prefetch_summaries(self) -> None:
        """Read every run's summary rows at once (without their checkpoints), for commands
        that look at every run."""
        for journal in self.sources:
            try:
                rows = journal.summaries(checkpoints=False)
            except JournalError as exc:
                self.problems.append(str(exc))
                continue
            by_run: dict[str, dict[int, Summary]] = {}
            for row in rows:
                by_run.setdefault(row.run_id, {})[row.rank] = row
            self._summaries[id(journal)] = by_run

    def _summaries_of(
        self, journal: Journal, run_id: str, *, checkpoints: bool = False
    ) -> dict[int, Summary]:
        cached = self._summaries.get(id(journal))
        if cached is not None and not checkpoints:
            return cached.get(run_id, {})
        if cached is not None and run_id not in cached:
            return {}
        try:
            return {row.rank: row for row in journal.summaries([run_id])}
        except JournalError as exc:
            self.problems.append(str(exc))
            return {}

    def _ranks_of(self, journal: Journal, run_id: str) -> list[int]:
        key = (id(journal), run_id)
        summarized = self._summaries.get(id(journal), {}).get(run_id)
        if summarized and key not in self._ranks:
            # A writer inserts its summary row with its first event: the ranks with events.
            self._ranks[key] = sorted(summarized)
        if key not in self._ranks:
            try:
                self._ranks[key] = journal.ranks(run_id)
            except JournalError as exc:
                self.problems.append(str(exc))
                self._ranks[key] = []
        return self._ranks[key]

    def _present_ranks(self, run_id: str, journals: list[Journal]) -> dict[int, Journal]:
        """Each rank that has events of the run, with the journal it is read from."""
        present: dict[int, Journal] = {}
        for journal in journals:
            for rank in self._ranks_of(journal, run_id):
                present.setdefault(rank, journal)
        return present

    def _started_world_sizes(self, run_id: str, present: dict[int, Journal]) -> dict[int, int]:
        """The world size each rank's first event, its `run_started`, records; a claim the rank
        itself does not fit in is no evidence."""
        claims: dict[int, int] = {}
        for rank, journal in sorted(present.items()):
            try:
                # Only the first event is wanted; the stream is dropped (and closed) at once.
                first = next(journal.read(run_id=run_id, rank=rank), None)
            except (JournalError, *DATA_ERRORS):
                first = None
            if first is None or not isinstance(first.event, RunStarted):
                continue
            world = first.event.world_size
            if 0 <= rank < world <= MAX_RANKS:
                claims[rank] = world
        return claims

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
        read once); a rank outside the run's world is set aside and said so. Merging keeps the
        readers' memory bounded: a collective is complete, and forgotten, soon after its last
        member started it.
        """
        streams = [
            self._guarded(journal, run.run_id, r) for r, journal in self._rank_sources(run, rank)
        ]
        yield from heapq.merge(*streams, key=lambda e: (e.wall_time, e.rank, e.seq))
        self._malformed()

    def views(self, run: RunInfo, *, check: bool = True) -> dict[int, RankView]:
        """Each rank's view from its summary row and the events after that row's checkpoint:
        what a verdict needs, without reading every event. A rank without a usable summary
        (a journal older than revision 0003, a damaged row) is folded from all its events;
        either way the view is the one `analyze` folds from every event, but for a serving
        rank that has not journaled its end: its latest heartbeat, which the summary row
        keeps in place, is folded in too.

        `check` holds each summary to the rank's last event first (one indexed lookup a
        rank): a journal whose rows were removed by hand is read for what it holds.
        """
        views: dict[int, RankView] = {}
        held: dict[int, dict[int, Summary]] = {}
        for r, journal in self._rank_sources(run, None):
            if id(journal) not in held:
                held[id(journal)] = self._summaries_of(journal, run.run_id, checkpoints=True)
            summary = held[id(journal)].get(r)
            if summary is not None and check and not self._summary_holds(journal, summary):
                summary = None
            fold = summary.restored() if summary is not None else None
            if fold is None:
                fold, summary = RankFold(run_id=run.run_id, rank=r), None
            if summary is None or summary.last_seq > fold.last_seq:
                for stored in self._guarded(journal, run.run_id, r, from_seq=fold.last_seq + 1):
                    fold.apply(stored)
            if summary is not None:
                # A serving rank's heartbeats are kept in its summary row, not journaled.
                with_latest_heartbeat(fold, summary.last_heartbeat_wall)
            views[r] = fold.view()
        self._malformed()
        return views

    def settled(self, run: RunInfo) -> list[Summary] | None:
        """The summaries of a run every rank of which ended healthy (ready, its ready action
        done, then a shutdown), from one journal that agrees with itself: such a run's verdict
        is `ready`, told without its folds. None for any other run."""
        if run.notes or len(run.sources) != 1:
            return None
        journal = next(j for j in self.sources if j.location == run.sources[0])
        summaries = self._summaries_of(journal, run.run_id)
        if sorted(summaries) != list(range(run.world_size)):
            return None
        if all(
            s.healthy and s.ended and s.ready_at is not None and s.state != State.FAILED
            for s in summaries.values()
        ):
            return [summaries[r] for r in range(run.world_size)]
        return None

    def last_collectives(self, run: RunInfo, rank: int, count: int) -> list[StoredEvent]:
        """A rank's last `count` collective records, from the first journal that has it."""
        for r, journal in self._rank_sources(run, rank):
            try:
                return journal.last_collectives(run.run_id, r, count)
            except JournalError as exc:
                self.problems.append(str(exc))
        return []

    def _summary_holds(self, journal: Journal, summary: Summary) -> bool:
        try:
            last = journal.last_seq(summary.run_id, summary.rank)
        except JournalError as exc:
            self.problems.append(str(exc))
            return False
        if last == summary.last_seq:
            return True
        self.problems.append(
            f"{journal.location}: run {summary.run_id} rank {summary.rank}: its summary"
            f" counts events to seq {summary.last_seq}, the journal holds them to seq {last};"
            " read from its events"
        )
        return False

    def _rank_sources(self, run: RunInfo, rank: int | None) -> list[tuple[int, Journal]]:
        """Each rank of the run (or only `rank`) with the first journal that has it; a rank
        outside the run's world is set aside and said so."""
        self.problems.extend(n for n in run.notes if n not in self.problems)
        chosen: list[tuple[int, Journal]] = []
        claimed: set[int] = set()
        outside: list[int] = []
        for journal in self.sources:
            if journal.location not in run.sources:
                continue
            for r in self._ranks_of(journal, run.run_id):
                if (rank is not None and r != rank) or r in claimed:
                    continue
                claimed.add(r)
                if not 0 <= r < run.world_size:
                    outside.append(r)
                    continue
                chosen.append((r, journal))
        if outside:
            self.problems.append(
                f"run {run.run_id}: events of rank {', '.join(map(str, sorted(outside)))} set"
                f" aside: outside its world of {run.world_size} rank(s)"
            )
        return chosen

    def _malformed(self) -> None:
        for journal in self.sources:
            self.problems.extend(m for m in journal.malformed_rows if m not in self.problems)

    def _guarded(
        self, journal: Journal, run_id: str, rank: int, *, from_seq: int = 0
    ) -> Iterator[StoredEvent]:
        """One rank's events; a read that fails part way keeps what came before it."""
        last = -1
        try:
            for stored in journal.read(run_id=run_id, rank=rank, from_seq=from_seq):
                last = stored.seq
                yield stored
        except JournalError as exc:
            self.problems.append(f"rank {rank}: {exc}")
        except DATA_ERRORS as exc:
            self.problems.append(
                f"{journal.location}: run {run_id} rank {rank}: events after seq {last} cannot"
                f" be read: {type(exc).__name__}"
            )


def _same_settings(config: dict[str, object], other: dict[str, object]) -> bool:
    """Whether two journals' copies of a run's settings agree, but for the journal each was
    written to: the nodes of a run under torchrun may each keep their own file."""
    return {k: v for k, v in config.items() if k != "db"} == {
        k: v for k, v in other.items() if k != "db"
    }
