"""Compile artifacts as the tests keep them: a compile key, an operator's key and another, the
signature a startup would give, a compiler cache folder packed, a journal with runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

from lifecycle.core.decisions.compiling import CompileKey
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.artifacts.archive import pack
from lifecycle.runtime.artifacts.signing import ArtifactKey, artifact_key
from lifecycle.store.journal import Journal
from lifecycle.store.learned.artifacts import ArtifactStore
from lifecycle.store.runs import run_row

KEY = CompileKey(
    fingerprint="f" * 16, model="micro-video", torch="2.13.0+cpu", python="3.11.2",
    machine="x86_64", backend="inductor", mode="default",
)  # fmt: skip
SIGNER = artifact_key({"LIFECYCLE_ARTIFACT_KEY": "operator-key-" + "7" * 32}, journal="j.db")
OTHER = artifact_key({"LIFECYCLE_ARTIFACT_KEY": "another-key-" + "3" * 32}, journal="j.db")


def signature(data: bytes, key: CompileKey = KEY, signer: ArtifactKey = SIGNER) -> str:
    """The signature a startup holding `signer` gives `data` kept under `key`."""
    return signer.sign(digest=hashlib.sha256(data).hexdigest(), key=key.key)


def archive(tmp_path: Path, files: dict[str, bytes]) -> bytes:
    """A compiler cache folder holding `files`, packed as the compile packs it."""
    folder = tmp_path / f"cache-{len(list(tmp_path.iterdir()))}"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return pack(folder)


def journal_with_runs(location: str, *run_ids: str, created_at: float) -> Journal:
    """A journal opened for writing with `run_ids` created a second apart from `created_at`."""
    journal = Journal.open_for_write(location)
    for n, run_id in enumerate(run_ids):
        journal.create_run(run_row(ServerArgs(), run_id=run_id, created_at=created_at + n))
    return journal


def store_of(journal: Journal) -> ArtifactStore:
    return ArtifactStore(journal.engine, journal.backend.url)
