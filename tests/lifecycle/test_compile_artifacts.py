"""The compiler's artifacts in the journal's keeping (README: "Compile and shapes, paid once
per fingerprint"): kept beside a SQLite journal and in a PostgreSQL database, never loaded
unless signed with the operator's key, whole and of the startup's own key, bounded in number,
written by two pods at once without a half-written one, removed by `db prune` with the runs
that used them, carried by `db copy`. Real SQLite files, a real PostgreSQL server, real tar
archives; no compile here (test_compile.py compiles)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from lifecycle.core.decisions.compiling import KEPT_PER_MODEL, CompileKey, stale_reason
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.artifactkey import ArtifactKey, artifact_key
from lifecycle.runtime.cachearchive import pack, unpack
from lifecycle.runtime.compilecache import load_artifact
from lifecycle.store.backends.schema import compile_artifacts
from lifecycle.store.journal import Journal
from lifecycle.store.learned.artifactfiles import ArtifactUnusable
from lifecycle.store.learned.artifacts import FIRST_KEPT, ArtifactStore
from lifecycle.store.runs import run_row
from lifecycle.store.upkeep.copy import copy_journal
from lifecycle.store.upkeep.prune import RetentionPolicy, prune

REPO = Path(__file__).resolve().parents[2]
# Root held to the permission bits, the sticky bit's included (see tests/conftest.py).
UNPRIVILEGED = (
    ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    if os.geteuid() == 0
    else []
)
KEY = CompileKey(
    fingerprint="f" * 16, model="micro-video", torch="2.13.0+cpu", python="3.11.2",
    machine="x86_64", backend="inductor", mode="default",
)  # fmt: skip
DAY = 86_400.0
SIGNER = artifact_key({"LIFECYCLE_ARTIFACT_KEY": "operator-key-" + "7" * 32}, journal="j.db")
OTHER = artifact_key({"LIFECYCLE_ARTIFACT_KEY": "another-key-" + "3" * 32}, journal="j.db")


def signature(data: bytes, key: CompileKey = KEY, signer: ArtifactKey = SIGNER) -> str:
    return signer.sign(digest=hashlib.sha256(data).hexdigest(), key=key.key)


def archive(tmp_path: Path, files: dict[str, bytes]) -> bytes:
    """A compiler cache folder holding `files`, packed as the compile packs it."""
    folder = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return pack(folder)


def journal_with_runs(location: str, *run_ids: str, created_at: float) -> Journal:
    journal = Journal.open_for_write(location)
    for n, run_id in enumerate(run_ids):
        journal.create_run(run_row(ServerArgs(), run_id=run_id, created_at=created_at + n))
    return journal


def store_of(journal: Journal) -> ArtifactStore:
    return ArtifactStore(journal.engine, journal.backend.url)


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


# -- what is loaded: only what the operator's key vouches for -------------------------------------

PLANTED = 'open(__import__("os").environ["MARKER"], "w").write("ran")\n'


def tampered(data: bytes, tmp_path: Path) -> bytes:
    """The artifact with code appended to each of its `.py` files, packed again."""
    folder = unpack(data, parent=tmp_path)
    for path in folder.rglob("*.py"):
        path.write_text(path.read_text() + PLANTED)
    return pack(folder)


def run_every_module(folder: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a compiler does with what it finds in its folder at worst: import every module."""
    import runpy

    monkeypatch.setenv("MARKER", str(marker))
    for path in folder.rglob("*.py"):
        runpy.run_path(str(path))


def kept_artifact(tmp_path: Path, location: str) -> tuple[Journal, bytes]:
    journal = journal_with_runs(location, "run-a", created_at=time.time())
    data = archive(tmp_path, {"fxgraph/entry": b"graph", "kernels/k.py": b"KERNEL = 1\n"})
    assert store_of(journal).keep(KEY, data, run_id="run-a", signature=signature(data)) is None
    return journal, data


def root_in(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    return root


def test_a_signed_artifact_loads_and_another_keys_is_rejected(tmp_path: Path) -> None:
    """Signed with the startup's key it loads (hit) into a new private folder, marked used;
    a startup holding another key rejects it, compiles cold and replaces it."""
    journal, data = kept_artifact(tmp_path, str(tmp_path / "j.db"))
    store = store_of(journal)
    hit = load_artifact(lambda: store, KEY, SIGNER, root=root_in(tmp_path), run_id="run-b")
    assert (hit.cache, hit.reason, hit.artifact_bytes) == ("hit", None, len(data))
    assert (hit.folder / "kernels/k.py").read_text() == "KERNEL = 1\n"
    assert store.candidates("micro-video")[0].used_run == "run-b"
    other = load_artifact(lambda: store, KEY, OTHER, root=root_in(tmp_path), run_id="run-c")
    assert (other.cache, other.replaces) == ("rejected", True)
    assert other.reason is not None and "signature does not verify" in other.reason
    assert list(other.folder.iterdir()) == []
    journal.close()


def test_an_unsigned_artifact_is_rejected_and_replaced(tmp_path: Path) -> None:
    """A row without a signature (kept before artifacts were signed): rejected as not signed,
    nothing unpacked, and the startup's own replaces it."""
    journal = journal_with_runs(str(tmp_path / "j.db"), "run-a", created_at=time.time())
    data = archive(tmp_path, {"kernels/k.py": b"KERNEL = 1\n"})
    store = store_of(journal)
    assert store.keep(KEY, data, run_id="run-a", signature=None) is None
    loaded = load_artifact(lambda: store, KEY, SIGNER, root=root_in(tmp_path), run_id="run-b")
    assert (loaded.cache, loaded.replaces) == ("rejected", True)
    assert loaded.reason is not None and "not signed" in loaded.reason
    assert list(loaded.folder.iterdir()) == []
    journal.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_database_writer_who_adds_code_to_an_artifact_is_rejected(
    tmp_path: Path, backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer of the database (any pod of a fleet) appends code to the artifact's `.py` files
    and updates its digest and size (and its bytes, or its file): rejected by its signature, and
    none of their code runs, whatever the compiler imports of its folder."""
    if backend == "postgresql":
        location = request.getfixturevalue("postgres").create_database("compile_tampered")
    else:
        location = str(tmp_path / "j.db")
    journal, data = kept_artifact(tmp_path, location)
    theirs = tampered(data, tmp_path)
    digest = hashlib.sha256(theirs).hexdigest()
    folder = tmp_path / "j.db.compile-cache"
    if backend == "sqlite":
        (folder / digest).write_bytes(theirs)
    with journal.engine.begin() as conn:
        conn.execute(
            compile_artifacts.update().values(
                digest=digest,
                size_bytes=len(theirs),
                data=theirs if backend == "postgresql" else None,
            )
        )
    store = store_of(journal)
    assert store.read(store.candidates("micro-video")[0]) == theirs  # whole, by its digest
    loaded = load_artifact(lambda: store, KEY, SIGNER, root=root_in(tmp_path), run_id="run-b")
    assert loaded.cache == "rejected" and loaded.replaces
    assert loaded.reason is not None and "signature does not verify" in loaded.reason
    marker = tmp_path / "marker"
    run_every_module(loaded.folder, marker, monkeypatch)
    assert not marker.exists()
    journal.close()


def test_a_planted_wal_and_a_swapped_folder_are_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer of the journal's directory, not of the database: a `j.db-wal` made from a copy
    of the database (SQLite replays it at open, `j.db` unchanged) that points the row at their
    tar, and `j.db.compile-cache/` swapped for their own folder. Rejected (they hold no key),
    and none of their code runs."""
    journal, data = kept_artifact(tmp_path, str(tmp_path / "j.db"))
    journal.close()
    settled = sqlite3.connect(tmp_path / "j.db")
    settled.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    settled.close()
    theirs = tampered(data, tmp_path)
    digest = hashlib.sha256(theirs).hexdigest()
    work = tmp_path / "attacker"
    work.mkdir()
    shutil.copyfile(tmp_path / "j.db", work / "j.db")
    conn = sqlite3.connect(work / "j.db")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("UPDATE compile_artifacts SET digest = ?, size_bytes = ?", (digest, len(theirs)))
    conn.commit()
    shutil.copyfile(work / "j.db-wal", tmp_path / "j.db-wal")
    conn.close()
    (tmp_path / "j.db-shm").unlink(missing_ok=True)
    shutil.rmtree(tmp_path / "j.db.compile-cache")
    (tmp_path / "j.db.compile-cache").mkdir()
    (tmp_path / "j.db.compile-cache" / digest).write_bytes(theirs)
    journal = Journal.open_for_write(str(tmp_path / "j.db"))
    store = store_of(journal)
    assert store.candidates("micro-video")[0].digest == digest  # the WAL was replayed
    loaded = load_artifact(lambda: store, KEY, SIGNER, root=root_in(tmp_path), run_id="run-b")
    assert loaded.cache == "rejected", loaded
    marker = tmp_path / "marker"
    run_every_module(loaded.folder, marker, monkeypatch)
    assert not marker.exists()
    journal.close()


# -- odd files where an artifact's file belongs ---------------------------------------------------


def test_a_fifo_at_an_artifacts_name_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO where the artifact's file belongs: refused by its kind within seconds (opening it
    to read would wait for a writer that never comes)."""
    journal, _ = kept_artifact(tmp_path, str(tmp_path / "j.db"))
    store = store_of(journal)
    (found,) = store.candidates("micro-video")
    path = tmp_path / "j.db.compile-cache" / found.digest
    path.unlink()
    os.mkfifo(path)
    said: list[str] = []

    def read() -> None:
        try:
            store.read(found)
        except ArtifactUnusable as exc:
            said.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    try:
        assert not reader.is_alive(), "reading the FIFO waited for a writer"
        assert said and "a FIFO, not a regular file" in said[0]
    finally:
        with contextlib.suppress(OSError):  # a reader left waiting is let go
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    journal.close()


def test_a_directory_at_an_artifacts_name_costs_the_startup_nothing(tmp_path: Path) -> None:
    """A directory where the artifact's file belongs: rejected by its kind, and the startup's
    own artifact is kept in its place, the directory (which cannot be removed as a file) left
    for `db prune` to report."""
    journal, _ = kept_artifact(tmp_path, str(tmp_path / "j.db"))
    store = store_of(journal)
    (found,) = store.candidates("micro-video")
    path = tmp_path / "j.db.compile-cache" / found.digest
    path.unlink()
    path.mkdir()
    (path / "inside").write_bytes(b"x")
    loaded = load_artifact(lambda: store, KEY, SIGNER, root=root_in(tmp_path), run_id="run-b")
    assert loaded.cache == "rejected" and loaded.replaces
    assert loaded.reason is not None and "a directory, not a regular file" in loaded.reason
    data = archive(tmp_path, {"fxgraph/entry": b"compiled anew"})
    kept = store.keep(KEY, data, run_id="run-b", signature=signature(data), replace=True)
    assert kept is None
    (now,) = store.candidates("micro-video")
    assert store.read(now) == data and path.is_dir()
    journal.close()


def test_an_old_file_that_cannot_be_removed_costs_the_startup_nothing(tmp_path: Path) -> None:
    """The artifact replaced is a file this process may not remove (another user's, in a folder
    with the sticky bit): the new one is kept all the same, and the old file is left."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user takes root")
    journal, _ = kept_artifact(tmp_path, str(tmp_path / "j.db"))
    journal.close()
    folder = tmp_path / "j.db.compile-cache"
    (old,) = list(folder.iterdir())
    for path in (old, folder):  # another user's file, in another user's folder open to all
        os.chown(path, 65534, 65534)
    folder.chmod(0o1777)
    code = (
        "import sys\n"
        "from lifecycle.store.journal import Journal\n"
        "from lifecycle.store.learned.artifacts import ArtifactStore\n"
        "from tests.lifecycle.test_compile_artifacts import KEY, archive, signature\n"
        "from pathlib import Path\n"
        "journal = Journal.open_for_write(sys.argv[1])\n"
        "data = archive(Path(sys.argv[2]), {'fxgraph/entry': b'compiled anew'})\n"
        "store = ArtifactStore(journal.engine, journal.backend.url)\n"
        "print(store.keep(KEY, data, run_id='run-b', signature=signature(data), replace=True))\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [*UNPRIVILEGED, sys.executable, "-c", code, str(tmp_path / "j.db"), str(work)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip() == "None"
    assert old.exists() and len(list(folder.iterdir())) == 2
