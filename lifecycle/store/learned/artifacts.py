"""The compiler's artifacts kept with the journal (revision 0005), so that every pod of a fleet
compiles from what one pod compiled: a row per compile key, the bytes in the row on a database
server and beside a SQLite journal in a folder of files named by their digest. Nothing is
loaded unless its digest matches; nothing half-written is ever found (a file is renamed into
place before its row commits, and a row commits whole)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, delete, exists, inspect, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from lifecycle.core.decisions.compiling import (
    KEPT_PER_MODEL,
    MAX_ARTIFACT_BYTES,
    CompileKey,
    is_digest,
)
from lifecycle.store.backends.dberrors import DATABASE_ERRORS
from lifecycle.store.backends.schema import compile_artifacts, runs
from lifecycle.store.location import sqlite_file

ARTIFACTS_REVISION = "0005"
FOLDER_SUFFIX = ".compile-cache"
# The rows a startup reads for its model: every key kept for it, and a margin for a journal
# written by many versions at once.
READ_ROWS = 4 * KEPT_PER_MODEL
FIRST_KEPT = "another startup of this key kept its artifact first"


class ArtifactUnusable(Exception):
    """A stored artifact that is not loaded, and why (one line)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredArtifact:
    compile_key: CompileKey
    key: str
    digest: str
    size_bytes: int
    stored_run: str
    stored_at: float
    used_run: str | None = None


def artifact_folder(url: str) -> Path | None:
    """Where a SQLite journal keeps its artifacts' bytes (beside its file); None for a journal
    on a database server, which keeps them in their rows."""
    database = sqlite_file(make_url(url))
    if database is None:
        return None
    path = Path(os.path.abspath(os.path.expanduser(database)))
    return path.with_name(path.name + FOLDER_SUFFIX)


def has_artifacts(conn: Connection) -> bool:
    """Whether the journal is at a revision that keeps artifacts (an older one compiles cold,
    and keeps nothing, until `lifecycle db upgrade`)."""
    return inspect(conn).has_table(compile_artifacts.name)


class ArtifactStore:
    """The artifacts of one journal, read and written on connections of their own."""

    def __init__(self, engine: Engine, url: str) -> None:
        self._engine = engine
        self._folder = artifact_folder(url)

    def candidates(self, model: str) -> list[StoredArtifact]:
        """The artifacts kept for `model`, newest first (none in an older journal)."""
        c = compile_artifacts.c
        with self._engine.connect() as conn:
            if not has_artifacts(conn):
                return []
            rows = conn.execute(
                select(
                    c.key,
                    c.fingerprint,
                    c.model,
                    c.torch,
                    c.python,
                    c.machine,
                    c.backend,
                    c.mode,
                    c.digest,
                    c.size_bytes,
                    c.stored_run,
                    c.stored_at,
                    c.used_run,
                )
                .where(c.model == model)
                .order_by(c.stored_at.desc())
                .limit(READ_ROWS)
            ).all()
        found = []
        for row in rows:
            key = CompileKey(
                fingerprint=str(row.fingerprint), model=str(row.model), torch=str(row.torch),
                python=str(row.python), machine=str(row.machine), backend=str(row.backend),
                mode=str(row.mode),
            )  # fmt: skip
            found.append(
                StoredArtifact(
                    compile_key=key,
                    key=str(row.key),
                    digest=str(row.digest),
                    size_bytes=int(row.size_bytes),
                    stored_run=str(row.stored_run),
                    stored_at=float(row.stored_at),
                    used_run=None if row.used_run is None else str(row.used_run),
                )
            )
        return found

    def every(self) -> list[StoredArtifact]:
        """Every artifact the journal keeps, oldest first (a few per model: see keep)."""
        with self._engine.connect() as conn:
            if not has_artifacts(conn):
                return []
            models = conn.execute(select(compile_artifacts.c.model).distinct()).scalars().all()
        found = [a for model in models for a in self.candidates(str(model))]
        return sorted(found, key=lambda a: a.stored_at)

    def read(self, artifact: StoredArtifact) -> bytes:
        """The artifact's bytes, whose digest matches the row's; ArtifactUnusable otherwise."""
        if not is_digest(artifact.digest) or not 0 < artifact.size_bytes <= MAX_ARTIFACT_BYTES:
            raise ArtifactUnusable(f"its row is malformed (digest {artifact.digest[:80]!r})")
        if self._folder is None:
            with self._engine.connect() as conn:
                data = conn.execute(
                    select(compile_artifacts.c.data).where(compile_artifacts.c.key == artifact.key)
                ).scalar()
            if not isinstance(data, bytes | memoryview):
                raise ArtifactUnusable("its row holds no bytes")
            data = bytes(data)
        else:
            path = self._folder / artifact.digest
            try:
                with path.open("rb") as file:
                    if not os.path.isfile(path):
                        raise ArtifactUnusable(f"{path} is not a regular file")
                    data = file.read(MAX_ARTIFACT_BYTES + 1)
            except OSError as exc:
                raise ArtifactUnusable(f"{path}: {exc.strerror or exc}") from None
        if len(data) != artifact.size_bytes:
            raise ArtifactUnusable(
                f"it holds {len(data)} bytes, its row says {artifact.size_bytes} (truncated?)"
            )
        if hashlib.sha256(data).hexdigest() != artifact.digest:
            raise ArtifactUnusable("its bytes do not match their digest (corrupt)")
        return data

    def keep(
        self, key: CompileKey, data: bytes, *, run_id: str, replace: bool = False
    ) -> str | None:
        """Keep `data` under `key`; None when kept, else why not (another pod kept the key
        first, it is too large, the journal could not be written). `replace`: in place of the
        key's artifact (one this startup loaded and compiled more to). The oldest keys of the
        model past KEPT_PER_MODEL are removed with their bytes."""
        if len(data) > MAX_ARTIFACT_BYTES:
            return f"{len(data):,} bytes is more than the {MAX_ARTIFACT_BYTES:,} kept at most"
        digest = hashlib.sha256(data).hexdigest()
        if self._folder is not None:
            try:
                self._write_file(digest, data)
            except OSError as exc:
                return f"{self._folder}: {exc.strerror or exc}"
        values = {
            "key": key.key, "fingerprint": key.fingerprint, "model": key.model,
            "torch": key.torch, "python": key.python, "machine": key.machine,
            "backend": key.backend, "mode": key.mode, "digest": digest,
            "size_bytes": len(data), "stored_run": run_id, "stored_at": time.time(),
            "data": data if self._folder is None else None,
        }  # fmt: skip
        c = compile_artifacts.c
        why: str | None = None
        removed: list[str] = []
        try:
            with self._engine.begin() as conn:
                if not has_artifacts(conn):
                    why = f"the journal is older than revision {ARTIFACTS_REVISION}"
                elif (
                    old := conn.execute(select(c.digest).where(c.key == key.key)).first()
                ) is not None:
                    if replace:
                        conn.execute(
                            update(compile_artifacts).where(c.key == key.key).values(**values)
                        )
                        removed = [str(old.digest)]
                    else:
                        why = FIRST_KEPT
                else:
                    conn.execute(compile_artifacts.insert().values(**values))
                    removed = self._trim(conn, key.model)
        except IntegrityError:
            why = FIRST_KEPT  # the same key inserted by another pod between the check and here
        except DATABASE_ERRORS as exc:
            first = str(getattr(exc, "orig", exc) or type(exc).__name__).splitlines()
            why = f"the journal could not be written: {(first or ['?'])[0][:200]}"
        if why is not None:
            removed = [digest]  # the file written for it, unless a row names the same bytes
        self._remove_unnamed(removed)
        return why

    def _remove_unnamed(self, digests: list[str]) -> None:
        if self._folder is None or not digests:
            return
        try:
            with self._engine.connect() as conn:
                unnamed = _unnamed(conn, digests)
        except DATABASE_ERRORS:
            return  # left for db prune, which removes files no row names
        self.remove_files(unnamed)

    def mark_used(self, key: str, *, run_id: str) -> None:
        """Note that `run_id` loaded `key` (db prune keeps what a kept run used)."""
        c = compile_artifacts.c
        with self._engine.begin() as conn:
            conn.execute(
                update(compile_artifacts)
                .where(c.key == key)
                .values(used_run=run_id, used_at=time.time())
            )

    def _write_file(self, digest: str, data: bytes) -> None:
        assert self._folder is not None
        self._folder.mkdir(mode=0o700, exist_ok=True)
        target = self._folder / digest
        if target.is_file() and target.stat().st_size == len(data):
            return  # the same bytes, by their digest
        fd, temporary = tempfile.mkstemp(dir=self._folder, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _trim(self, conn: Connection, model: str) -> list[str]:
        """Remove the model's oldest keys past KEPT_PER_MODEL; the digests no row names now."""
        c = compile_artifacts.c
        old = conn.execute(
            select(c.key, c.digest)
            .where(c.model == model)
            .order_by(c.stored_at.desc())
            .offset(KEPT_PER_MODEL)
        ).all()
        if not old:
            return []
        conn.execute(delete(compile_artifacts).where(c.key.in_([row.key for row in old])))
        return _unnamed(conn, [str(row.digest) for row in old])

    def remove_files(self, digests: list[str]) -> int:
        """Remove the files of `digests` beside a SQLite journal; how many went."""
        if self._folder is None:
            return 0
        removed = 0
        for digest in digests:
            if is_digest(digest):
                with contextlib.suppress(FileNotFoundError):
                    (self._folder / digest).unlink()
                    removed += 1
        return removed


def _unnamed(conn: Connection, digests: list[str]) -> list[str]:
    c = compile_artifacts.c
    return [
        d
        for d in dict.fromkeys(digests)
        if not conn.execute(select(exists().where(c.digest == d))).scalar()
    ]


def prune_artifacts(conn: Connection) -> tuple[int, list[str]]:
    """Remove the artifacts that no run still in the journal stored or used: how many, and the
    digests no row names any more (their files go after the transaction commits)."""
    if not has_artifacts(conn):
        return 0, []
    c = compile_artifacts.c
    kept_runs = select(runs.c.run_id)
    orphaned = conn.execute(
        select(c.key, c.digest).where(
            c.stored_run.not_in(kept_runs), (c.used_run.is_(None)) | c.used_run.not_in(kept_runs)
        )
    ).all()
    if not orphaned:
        return 0, []
    conn.execute(delete(compile_artifacts).where(c.key.in_([row.key for row in orphaned])))
    return len(orphaned), _unnamed(conn, [str(row.digest) for row in orphaned])
