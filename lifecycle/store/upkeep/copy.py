"""`lifecycle db copy`: a node's journal (its black box) into the fleet's, run by run.

Each rank's rows are written as its own writer wrote them: the same sequence numbers (a gap
stays a gap), states, times, kinds, versions and payloads, a kind this lifecycle cannot read
included. They go through a RankWriter, so the copy gets its summaries, fold checkpoints and
key checks. A rank the destination holds up to the source's last row is left as it is and
counted; one it holds the start of (a run that was still being written at the last copy) is
completed from where it ends.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from lifecycle.core.decisions.compiling import CacheUse
from lifecycle.core.errors import ConfigError, JournalConflict, JournalError, JournalWriteFailed
from lifecycle.core.format.events import Compiled, UnknownEvent
from lifecycle.core.format.runid import checked_run_id
from lifecycle.store.backends.dberrors import DATABASE_ERRORS
from lifecycle.store.journal import Journal
from lifecycle.store.learned.artifactfiles import ArtifactUnusable
from lifecycle.store.learned.artifacts import FIRST_KEPT, ArtifactStore
from lifecycle.store.rows import RunRow
from lifecycle.store.writer import RankWriter, StoredRow

COPY_BATCH = 1000  # rows a transaction


@dataclass(slots=True)
class Copied:
    """What a copy has written so far, and what it found there already or could not write."""

    runs: int = 0  # runs with rows written by this copy
    ranks: int = 0
    events: int = 0
    present: int = 0  # ranks the destination held whole already
    completed: int = 0  # ranks it held the start of, completed
    undecodable: int = 0  # rows this lifecycle cannot read, written as they are
    left_out: int = 0  # rows that cannot be written as they are (a malformed row): seq gaps
    left_out_why: str | None = None  # what the first row left out is, in words
    artifacts: int = 0  # compile artifacts of the runs copied, carried with them
    artifacts_left: list[str] = field(default_factory=list)  # why each one was not
    # The artifacts the copied runs loaded (a hit), by key: the newest such run of each. The
    # source's row names only the last run that used one, which may not be copied.
    loaded: dict[str, str] = field(default_factory=dict)

    def written(self) -> str:
        return f"{self.events:,} events of {self.ranks} rank(s) in {self.runs} run(s)"

    def line(self, source: str, destination: str) -> str:
        text = f"{source} -> {destination}: copied {self.written()}"
        if self.completed:
            text += f" ({self.completed} of them completed from where an earlier copy ended)"
        if self.undecodable:
            text += (
                f", {self.undecodable} row(s) among them that this version cannot read"
                " (copied as they are)"
            )
        if self.present:
            text += f"; {self.present} rank(s) already there, left as they are"
        if self.left_out:
            text += f"; {self.left_out} malformed row(s) left out (a gap in their rank's seq"
            text += f"; the first: {self.left_out_why})" if self.left_out_why else ")"
        if self.artifacts:
            text += f"; {self.artifacts} compile artifact(s) carried with them"
        if self.artifacts_left:
            text += f"; {len(self.artifacts_left)} compile artifact(s) not carried"
            text += f" ({self.artifacts_left[0]})"
        return text


class CopyStopped(JournalError):
    """A copy stopped part way by a journal error: the error, what was copied before it (which
    stays in the destination, and a later copy completes), and the run it stopped at."""

    def __init__(
        self, *, error: JournalError, copied: Copied, run_id: str, destination: str
    ) -> None:
        self.error = error
        self.copied = copied
        self.run_id = run_id
        self.destination = destination
        said = str(error)
        if isinstance(error, JournalWriteFailed) and not self.unjournaled:
            said = f"{error.location}: could not be read: {error.reason}"  # the source's server
        super().__init__(
            f"{said}; the copy stopped at run {run_id}, after copying {copied.written()}"
            f" into {destination}"
        )

    @property
    def unjournaled(self) -> bool:
        """Whether the destination could not be written (exit 3); a source that could not be
        read, its server gone included, is bad input."""
        return (
            isinstance(self.error, JournalWriteFailed) and self.error.location == self.destination
        )


def runs_to_copy(source: Journal, run_ids: Sequence[str] | None) -> list[RunRow]:
    """The runs of `source` to copy: every one, or those `run_ids` names, each of which must be
    a run of the source (ConfigError otherwise, before anything is written)."""
    found = source.runs()
    if run_ids is None:
        return found
    wanted = {checked_run_id(run_id, source="--run") for run_id in run_ids}
    missing = sorted(wanted - {run.run_id for run in found})
    if missing:
        raise ConfigError(
            f"--run {', '.join(missing)}: {source.location} holds no such run", field="run"
        )
    return [run for run in found if run.run_id in wanted]


def copy_journal(source: Journal, destination: Journal, *, run_ids: Sequence[str] | None) -> Copied:
    """Copy every run of `source` (or those `run_ids` names) into `destination`; CopyStopped,
    saying how far it got, when a journal error stops it."""
    done = Copied()
    for run in runs_to_copy(source, run_ids):
        try:
            _copy_run(source, destination, run, done)
        except JournalError as exc:
            raise CopyStopped(
                error=exc, copied=done, run_id=run.run_id, destination=destination.location
            ) from None
    _copy_artifacts(
        source, destination, {run.run_id for run in runs_to_copy(source, run_ids)}, done
    )
    return done


def _copy_artifacts(source: Journal, destination: Journal, run_ids: set[str], done: Copied) -> None:
    """Carry the compile artifacts that the copied runs stored or used, each checked against
    its digest, with its signature as it is (a copy never signs: a startup checks it), and the
    copied run that used it; one the destination has (by key) is left as it is there."""
    origin = ArtifactStore(source.engine, source.backend.url)
    try:
        wanted = [
            a
            for a in origin.every()
            if a.stored_run in run_ids or a.used_run in run_ids or a.key in done.loaded
        ]
    except DATABASE_ERRORS as exc:
        done.artifacts_left.append(f"{source.location}: could not be read: {exc}"[:200])
        return
    into = ArtifactStore(destination.engine, destination.backend.url)
    for artifact in wanted:
        try:
            data = origin.read(artifact)
        except ArtifactUnusable as exc:
            done.artifacts_left.append(f"{artifact.key}: {exc}")
            continue
        why = into.keep(
            artifact.compile_key, data, run_id=artifact.stored_run, signature=artifact.signature
        )
        if why is not None and why != FIRST_KEPT:
            done.artifacts_left.append(f"{artifact.key}: {why}")
            continue
        done.artifacts += why is None
        used = artifact.used_run if artifact.used_run in run_ids else None
        used = max(filter(None, (used, done.loaded.get(artifact.key))), default=None)
        if used is not None:
            _mark_used(into, artifact.key, used, done)


def _mark_used(into: ArtifactStore, key: str, run_id: str | None, done: Copied) -> None:
    """Note in the destination that a copied run used the artifact, as the source did (so
    that its `db prune` keeps the artifact while it keeps the run)."""
    assert run_id is not None
    try:
        into.mark_used(key, run_id=run_id)
    except DATABASE_ERRORS as exc:
        done.artifacts_left.append(f"{key}: its use by run {run_id} not noted: {exc}"[:200])


def _copy_run(source: Journal, destination: Journal, run: RunRow, done: Copied) -> None:
    destination.create_run(run)
    counted = False
    for rank in source.ranks(run.run_id):
        have = destination.last_seq(run.run_id, rank)
        last = source.last_seq(run.run_id, rank)
        if have is not None and (last is None or have >= last):
            done.present += 1
            continue
        written = _copy_rank(source, destination, run.run_id, rank, have=have, done=done)
        if written is None:
            done.present += 1
        elif written:
            done.ranks += 1
            done.completed += have is not None
            if not counted:
                done.runs += 1
                counted = True
        elif have is not None:
            done.present += 1  # all the source holds past it are rows left out


def _copy_rank(
    source: Journal, destination: Journal, run_id: str, rank: int, *, have: int | None, done: Copied
) -> int | None:
    """Write the rank's rows after `have`; how many, or None when another writer holds it."""
    writer: RankWriter | None = None
    batch: list[StoredRow] = []
    written = 0
    said = len(source.malformed_rows)

    def flush() -> None:
        nonlocal writer, written, batch
        if writer is None:
            writer = destination.writer(run_id=run_id, rank=rank, resume=have is not None)
        writer.append_rows(batch)
        written += len(batch)
        done.events += len(batch)
        done.undecodable += sum(isinstance(row.stored.event, UnknownEvent) for row in batch)
        batch = []

    try:
        for row in source.read_rows(
            run_id=run_id, rank=rank, from_seq=0 if have is None else have + 1
        ):
            if not _writable_as_is(row):
                done.left_out += 1
                done.left_out_why = done.left_out_why or (
                    f"run {run_id} rank {rank} seq {row.stored.seq}: its payload is not strict JSON"
                )
                continue
            batch.append(row)
            _note_loaded(row, run_id, done)
            if len(batch) == COPY_BATCH:
                flush()
        if batch:
            flush()
    except JournalConflict:
        if not written:
            return None  # another copy or writer took the rank first
        raise
    finally:
        said_now = source.malformed_rows[said:]  # read_rows says each it leaves out
        done.left_out += len(said_now)
        if said_now and done.left_out_why is None:
            done.left_out_why = said_now[0][:300]
        if writer is not None:
            writer.close()
    return written


def _note_loaded(row: StoredRow, run_id: str, done: Copied) -> None:
    """Note the artifact a copied row says its run loaded, so that it is carried."""
    event = row.stored.event
    if isinstance(event, Compiled) and event.cache == CacheUse.HIT.value and event.key:
        done.loaded[event.key] = max(run_id, done.loaded.get(event.key, run_id))


def _refuse(constant: str) -> object:
    raise ValueError(f"{constant} is not JSON")


def _writable_as_is(row: StoredRow) -> bool:
    """Whether a row's payload is strict JSON, which every journal's `data` column accepts (a
    server's JSON type refuses anything else). A payload this lifecycle decoded is JSON;
    only `NaN` and `Infinity`, which Python's reader lets through, need looking for."""
    if not isinstance(row.stored.event, UnknownEvent) and not (
        "NaN" in row.data or "Infinity" in row.data
    ):
        return True
    try:
        json.loads(row.data, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return False
    return True
