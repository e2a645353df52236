"""Which of the journal's compile artifacts a startup loads (docs/compile.md): only one the
operator's key signed, whatever a writer of the database or of the journal's directory planted, and
an odd file where an artifact's file belongs costs the startup nothing. Real SQLite files, a real
PostgreSQL server, real tar archives; no compile here (test_compile.py compiles)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lifecycle.runtime.artifacts.archive import pack, unpack
from lifecycle.runtime.artifacts.cacheload import load_artifact
from lifecycle.store.backends.schema import compile_artifacts
from lifecycle.store.journal import Journal
from lifecycle.store.learned.artifactfiles import ArtifactUnusable
from tests.support.artifacts import (
    KEY,
    OTHER,
    SIGNER,
    archive,
    journal_with_runs,
    signature,
    store_of,
)

REPO = Path(__file__).resolve().parents[2]
# Root held to the permission bits, the sticky bit's included (see tests/conftest.py).
UNPRIVILEGED = (
    ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]
    if os.geteuid() == 0
    else []
)


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
        "from tests.support.artifacts import KEY, archive, signature\n"
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
