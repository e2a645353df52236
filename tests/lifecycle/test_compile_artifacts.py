"""The compiler's artifacts in the journal's keeping (docs/compile.md): kept beside a SQLite journal
and in a PostgreSQL database with their signature, never read unless whole, bounded in number,
written by two pods at once without a half-written one, removed by `db prune` with the runs that
used them, carried by `db copy`. Real SQLite files, a real PostgreSQL server, real tar archives; no
compile here (test_compile.py compiles, test_artifact_trust.py loads)."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.decisions.compiling import KEPT_PER_MODEL, stale_reason
from lifecycle.runtime.artifacts.archive import unpack
from lifecycle.store.backends.schema import compile_artifacts
from lifecycle.store.journal import Journal
from lifecycle.store.learned.artifactfiles import ArtifactUnusable
from lifecycle.store.learned.artifacts import FIRST_KEPT
from lifecycle.store.upkeep.copy import copy_journal
from lifecycle.store.upkeep.prune import RetentionPolicy, prune
from tests.support.artifacts import KEY, archive, journal_with_runs, signature, store_of

DAY = 86_400.0


def test_an_artifact_is_kept_beside_a_sqlite_journal_and_read_back_whole(tmp_path: Path) -> None:
    """Kept, it is a file named by its digest beside the journal and a row without the bytes,
    with its signature; read back, it is the same bytes, and it unpacks into the files it was
    packed from."""
    journal = journal_with_runs(str(tmp_path / "j.db"), "run-a", created_at=time.time())
    store = store_of(journal)
    data = archive(tmp_path, {"fxgraph/ab/entry": b"graph" * 100, "aotautograd/x": b"aot"})
    assert store.keep(KEY, data, run_id="run-a", signature=signature(data)) is None
    (found,) = store.candidates("micro-video")
    assert (found.key, found.compile_key, found.size_bytes) == (KEY.key, KEY, len(data))
    assert found.signature == signature(data)
    assert [p.name for p in (tmp_path / "j.db.compile-cache").iterdir()] == [found.digest]
    assert store.read(found) == data
    into = unpack(store.read(found), parent=tmp_path)
    assert (into / "fxgraph/ab/entry").read_bytes() == b"graph" * 100
    journal.close()


def test_an_artifact_is_kept_in_a_postgresql_journal(postgres: Any) -> None:
    """On PostgreSQL the bytes are in the row, for every pod that reaches the database."""
    url = postgres.create_database("compile_artifacts")
    journal = journal_with_runs(url, "run-a", created_at=time.time())
    store = store_of(journal)
    data = b"\x1f\x8b" + b"x" * 5000
    assert store.keep(KEY, data, run_id="run-a", signature=signature(data)) is None
    (found,) = store.candidates("micro-video")
    assert store.read(found) == data and found.signature == signature(data)
    journal.close()


def test_truncated_or_garbage_bytes_are_never_loaded(tmp_path: Path) -> None:
    """A file cut short, or the same length of other bytes, is refused by size or digest."""
    journal = journal_with_runs(str(tmp_path / "j.db"), "run-a", created_at=time.time())
    store = store_of(journal)
    data = archive(tmp_path, {"fxgraph/entry": b"kernel" * 1000})
    store.keep(KEY, data, run_id="run-a", signature=signature(data))
    (found,) = store.candidates("micro-video")
    path = tmp_path / "j.db.compile-cache" / found.digest
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactUnusable, match="truncated"):
        store.read(found)
    path.write_bytes(bytes(len(data)))
    with pytest.raises(ArtifactUnusable, match="do not match their digest"):
        store.read(found)
    path.unlink()
    with pytest.raises(ArtifactUnusable, match="No such file"):
        store.read(found)
    journal.close()


def test_a_stale_artifact_says_what_differs() -> None:
    """Another torch, Python, mode or machine: each named, with both sides."""
    other = dataclasses.replace(KEY, torch="2.12.0+cpu", mode="max-autotune")
    said = stale_reason(KEY, other)
    assert "compiled by torch 2.12.0+cpu, this is torch 2.13.0+cpu" in said
    assert "compiled with backend=inductor mode=max-autotune, this asks" in said
    assert "layout" in stale_reason(KEY, dataclasses.replace(KEY, fingerprint="0" * 16))


def test_a_journal_of_a_thousand_artifacts_stays_bounded(tmp_path: Path) -> None:
    """A thousand artifacts of other models cost a startup nothing (it reads its model's
    through the index), and keys stored one after another keep the model's newest
    KEPT_PER_MODEL, with exactly their files beside the journal."""
    journal = journal_with_runs(str(tmp_path / "j.db"), "run-a", created_at=time.time())
    store = store_of(journal)
    with journal.engine.begin() as conn:
        conn.execute(
            compile_artifacts.insert(),
            [
                {**dataclasses.asdict(dataclasses.replace(KEY, model=f"m{n % 125}")),
                 "key": f"{n:032x}", "digest": "0" * 64, "size_bytes": 1,
                 "stored_run": "run-a", "stored_at": float(n), "data": None}
                for n in range(1000)
            ],
        )  # fmt: skip
    assert len(store.candidates("m7")) == 8 and store.candidates("micro-video") == []
    for n in range(40):
        key = dataclasses.replace(KEY, fingerprint=f"{n:016x}")
        data = f"artifact {n}".encode()
        assert store.keep(key, data, run_id="run-a", signature=signature(data, key)) is None
    kept = store.candidates("micro-video")
    assert [a.compile_key.fingerprint for a in kept] == [f"{n:016x}" for n in range(39, 31, -1)]
    assert len(kept) == KEPT_PER_MODEL
    files = {p.name for p in (tmp_path / "j.db.compile-cache").iterdir()}
    assert files == {a.digest for a in kept}
    journal.close()


def test_two_pods_keeping_one_key_at_once_leave_one_whole_artifact(tmp_path: Path) -> None:
    """Eight writers of the same key at once (as pods of a fleet finishing together): one
    keeps it, the others are told another kept it first, and one file is left, whole."""
    db = str(tmp_path / "j.db")
    journal_with_runs(db, "run-a", created_at=time.time()).close()
    said: list[str | None] = []
    start = threading.Barrier(8)

    def pod(n: int) -> None:
        journal = Journal.open_for_write(db)
        try:
            start.wait(timeout=30)
            data = f"pod {n}".encode() * 500
            kept = store_of(journal).keep(KEY, data, run_id="run-a", signature=signature(data))
            said.append(kept)
        finally:
            journal.close()

    threads = [threading.Thread(target=pod, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(said, key=str) == [None] + [FIRST_KEPT] * 7
    journal = Journal.open_for_read(db)
    (found,) = store_of(journal).candidates("micro-video")
    assert [p.name for p in (tmp_path / "j.db.compile-cache").iterdir()] == [found.digest]
    assert store_of(journal).read(found).startswith(b"pod ")
    journal.close()


def test_a_database_gone_while_keeping_costs_the_artifact_not_the_startup(postgres: Any) -> None:
    """A PostgreSQL database that went away: keep says why in a line, and nothing is kept."""
    url = postgres.create_database("compile_gone")
    journal = journal_with_runs(url, "run-a", created_at=time.time())
    store = store_of(journal)
    import psycopg

    with psycopg.connect(postgres.dsn("postgres"), autocommit=True) as conn:
        conn.execute('DROP DATABASE "compile_gone" WITH (FORCE)')
    why = store.keep(KEY, b"artifact", run_id="run-a", signature=signature(b"artifact"))
    assert why is not None and why.startswith("the journal could not be written: "), why
    assert "\n" not in why


def test_prune_removes_the_artifacts_no_kept_run_stored_or_used(tmp_path: Path) -> None:
    """`db prune` removes old runs and, with them, each artifact that only they stored or
    used (rows and files); one a kept run used stays."""
    db = str(tmp_path / "j.db")
    journal = journal_with_runs(db, "run-a", "run-b", "run-c", created_at=time.time() - 30 * DAY)
    store = store_of(journal)
    used = dataclasses.replace(KEY, fingerprint="used" * 4)
    store.keep(KEY, b"only run-a", run_id="run-a", signature=signature(b"only run-a"))
    kept = b"run-a's, used by run-c"
    store.keep(used, kept, run_id="run-a", signature=signature(kept, used))
    store.mark_used(used.key, run_id="run-c")
    outcome = prune(journal, RetentionPolicy(keep_runs=1), now=time.time(), pause=lambda _: None)
    assert outcome.runs_removed == 2 and outcome.artifacts_removed == 1
    (left,) = store.candidates("micro-video")
    assert left.key == used.key
    assert [p.name for p in (tmp_path / "j.db.compile-cache").iterdir()] == [left.digest]
    journal.close()


def test_db_copy_carries_the_artifacts_of_the_runs_it_copies(tmp_path: Path) -> None:
    """A node's SQLite journal copied into the fleet's carries each artifact its runs kept,
    checked against its digest; a corrupt one is left behind and said."""
    source = journal_with_runs(str(tmp_path / "node.db"), "run-a", created_at=time.time())
    store = store_of(source)
    corrupt = dataclasses.replace(KEY, mode="max-autotune")
    store.keep(KEY, b"whole", run_id="run-a", signature=signature(b"whole"))
    damaged_bytes = b"to be damaged"
    store.keep(corrupt, damaged_bytes, run_id="run-a", signature=signature(damaged_bytes, corrupt))
    damaged = next(a for a in store.candidates("micro-video") if a.key == corrupt.key)
    (tmp_path / "node.db.compile-cache" / damaged.digest).write_bytes(b"to be DAMAGED")
    fleet = Journal.open_for_write(str(tmp_path / "fleet.db"))
    copied = copy_journal(source, fleet, run_ids=None)
    assert copied.artifacts == 1 and len(copied.artifacts_left) == 1
    assert "do not match their digest" in copied.artifacts_left[0]
    (carried,) = store_of(fleet).candidates("micro-video")
    assert (carried.key, store_of(fleet).read(carried)) == (KEY.key, b"whole")
    assert carried.signature == signature(b"whole")
    assert "1 compile artifact(s) carried" in copied.line("node.db", "fleet.db")
    fleet.close()
    source.close()


def test_db_copy_out_of_a_journal_of_0005_carries_its_artifacts_unsigned(tmp_path: Path) -> None:
    """A source at revision 0005 (no signatures yet) is read as it is: its artifact is carried
    unsigned, as it was kept, for a startup to reject and replace."""
    from alembic import command

    from lifecycle.store.backends.revisions import alembic_config
    from lifecycle.store.location import to_url

    node = tmp_path / "node.db"
    command.upgrade(alembic_config(to_url(str(node))), "0005")
    with sqlite3.connect(node) as conn:
        conn.execute(
            "INSERT INTO runs (run_id, created_at, host, world_size, config, lifecycle_version)"
            " VALUES ('run-a', 1.8e9, 'h', 1, '{}', '0.1.0')"
        )
        conn.execute(
            "INSERT INTO compile_artifacts (key, fingerprint, model, torch, python, machine,"
            " backend, mode, digest, size_bytes, stored_run, stored_at)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'run-a', 1.8e9)",
            (KEY.key, KEY.fingerprint, KEY.model, KEY.torch, KEY.python, KEY.machine,
             KEY.backend, KEY.mode, hashlib.sha256(b"old").hexdigest(), 3),
        )  # fmt: skip
    folder = tmp_path / "node.db.compile-cache"
    folder.mkdir()
    (folder / hashlib.sha256(b"old").hexdigest()).write_bytes(b"old")
    source = Journal.open_for_read(str(node))
    assert source.revision == "0005"
    fleet = Journal.open_for_write(str(tmp_path / "fleet.db"))
    copied = copy_journal(source, fleet, run_ids=None)
    assert copied.artifacts == 1, copied.artifacts_left
    (carried,) = store_of(fleet).candidates("micro-video")
    assert (carried.signature, store_of(fleet).read(carried)) == (None, b"old")
    fleet.close()
    source.close()
