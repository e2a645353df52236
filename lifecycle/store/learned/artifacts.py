"""The compiler's artifacts kept with the journal (revision 0005, signed from 0006), so that
every pod of a fleet compiles from what one pod compiled: a row per compile key, the bytes in
the row on a database server and beside a SQLite journal in a folder of files named by their
digest. Nothing is read unless it is a regular file whose digest matches (its signature is
the loader's to check: lifecycle.runtime.artifacts.cacheload); nothing half-written is ever
found (a file is renamed into place before its row commits, and a row commits whole)."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection, Engine, delete, exists, inspect, null, select, update
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
from lifecycle.store.learned.artifactfiles import (
    ArtifactUnusable,
    read_file,
    remove_named,
    stale_files,
    write_file,
)
from lifecycle.store.location import sqlite_file

ARTIFACTS_REVISION = "0005"
FOLDER_SUFFIX = ".compile-cache"
# The rows a startup reads for its model: every key kept for it, and a margin for a journal
# written by many versions at once.
READ_ROWS = 4 * KEPT_PER_MODEL
FIRST_KEPT = "another startup of this key kept its artifact first"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredArtifact:
    compile_key: CompileKey
    key: str
    digest: str
    size_bytes: int
    stored_run: str
    stored_at: float
    used_run: str | None = None
    signature: str | None = None  # HMAC-SHA256 of the operator's key; None: not signed


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


def _has_signatures(conn: Connection) -> bool:
    columns = inspect(conn).get_columns(compile_artifacts.name)
    return any(column["name"] == "signature" for column in columns)


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
            signature = c.signature if _has_signatures(conn) else null().label("signature")
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
                    signature,
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
                    signature=None if row.signature is None else str(row.signature),
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
            data = read_file(self._folder / artifact.digest)
        if len(data) != artifact.size_bytes:
            raise ArtifactUnusable(
                f"it holds {len(data)} bytes, its row says {artifact.size_bytes} (truncated?)"
            )
        if hashlib.sha256(data).hexdigest() != artifact.digest:
            raise ArtifactUnusable("its bytes do not match their digest (corrupt)")
        return data

    def keep(
        self,
        key: CompileKey,
        data: bytes,
        *,
        run_id: str,
        signature: str | None,
        replace: bool = False,
    ) -> str | None:
        """Keep `data` under `key` with its `signature` (None: unsigned, never loaded); None
        when kept, else why not (another pod kept the key first, it is too large, the journal
        could not be written). `replace`: in place of the key's artifact (one this startup
        loaded and compiled more to, or rejected). The oldest keys of the model past
        KEPT_PER_MODEL are removed with their bytes; a file that cannot be removed is left for
        `db prune`, and never costs the keep."""
        if len(data) > MAX_ARTIFACT_BYTES:
            return f"{len(data):,} bytes is more than the {MAX_ARTIFACT_BYTES:,} kept at most"
        digest = hashlib.sha256(data).hexdigest()
        if self._folder is not None:
            try:
                write_file(self._folder, digest, data)
            except OSError as exc:
                return f"{self._folder}: {exc.strerror or exc}"
        values = {
            "key": key.key, "fingerprint": key.fingerprint, "model": key.model,
            "torch": key.torch, "python": key.python, "machine": key.machine,
            "backend": key.backend, "mode": key.mode, "digest": digest,
            "size_bytes": len(data), "stored_run": run_id, "stored_at": time.time(),
            "data": data if self._folder is None else None, "signature": signature,
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

    def remove_files(self, digests: list[str]) -> tuple[int, list[str]]:
        """Remove the files of `digests` beside a SQLite journal: how many went, and a line for
        each that could not (a directory at its name, a folder this process may not write)."""
        if self._folder is None:
            return 0, []
        return remove_named(self._folder, [d for d in digests if is_digest(d)])

    def remove_unnamed_files(self, *, before: float) -> tuple[int, list[str]]:
        """Remove the regular files beside a SQLite journal named like a digest that no row
        names, and the temporary files a keep left, each last written before `before` (a newer
        one may be a keep's, its row not yet committed): how many went, and a line for each
        that could not."""
        if self._folder is None:
            return 0, []
        stale, left = stale_files(self._folder, before=before)
        digests = [name for name in stale if is_digest(name)]
        with self._engine.connect() as conn:
            unnamed = set(_unnamed(conn, digests)) if has_artifacts(conn) else set(digests)
        removed, more = remove_named(
            self._folder, [n for n in stale if n in unnamed or not is_digest(n)]
        )
        return removed, left + more


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
