"""A rank's compiler folders, private to it, and the journal's artifact loaded into them: only
one the operator's key signed, whole, of the startup's own key. See docs/compile.md."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lifecycle.core.decisions.compiling import CacheUse, CompileKey, stale_reason
from lifecycle.core.errors import JournalError
from lifecycle.runtime.artifacts.archive import unpack
from lifecycle.runtime.artifacts.signing import ArtifactKey
from lifecycle.runtime.group.signals import before_leaving
from lifecycle.store.backends.dberrors import DATABASE_ERRORS
from lifecycle.store.learned.artifactfiles import ArtifactUnusable
from lifecycle.store.learned.artifacts import ArtifactStore

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"
# A journal that cannot be read or written costs the cache, never the startup.
JOURNAL_ERRORS: tuple[type[Exception], ...] = (JournalError, *DATABASE_ERRORS)
NOT_SIGNED = (
    "it is not signed (kept before artifacts were signed, or copied from a journal of then)"
)
BAD_SIGNATURE = (
    "its signature does not verify with this startup's artifact key (kept under another key,"
    " or written by someone without it)"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CompilerFolders:
    """One rank process's compiler folders, all in one new folder (mode 0700) of its own:
    `tmp` (its TMPDIR, which inductor's compile workers inherit) and `headers` (inductor's
    precompiled headers, otherwise in $TMPDIR/torchinductor_$USER, shared by every process of
    the user). The cache folder inductor and triton use is made in `root` once the artifact is
    loaded; it is the only one packed into an artifact."""

    root: Path
    tmp: Path
    headers: Path


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    """What the compile made of the journal's artifact."""

    cache: CacheUse
    reason: str | None
    folder: Path  # the compiler's cache folder: the artifact unpacked, or a new empty one
    artifact_bytes: int = 0
    replaces: bool = False  # what this startup keeps goes in place of the key's artifact


def private_compiler_folders() -> CompilerFolders:
    """Make this process's compiler folders and point the compiler at them, from now on: what
    they hold is what this startup compiled or loaded, and nothing another process wrote."""
    root = Path(tempfile.mkdtemp(prefix="lifecycle-compile-"))
    folders = CompilerFolders(root=root, tmp=root / "tmp", headers=root / "precompiled_headers")
    folders.tmp.mkdir(mode=0o700)
    folders.headers.mkdir(mode=0o700)
    os.environ["TMPDIR"] = str(folders.tmp)
    tempfile.tempdir = str(folders.tmp)
    remove = lambda: shutil.rmtree(root, ignore_errors=True)  # noqa: E731
    before_leaving(remove)  # a process that ends through leave_process
    atexit.register(remove)  # and one that returns
    _headers_into(folders.headers)
    return folders


def _headers_into(folder: Path) -> None:
    """Inductor computes where its precompiled headers go when it is imported, from the
    temporary folder of then: pointed at `folder` (imported here, if it is not yet)."""
    from torch._inductor import codecache

    codecache._HEADER_DIR = str(folder)
    codecache._HEADER_LOCK_DIR = str(folder / "locks")


def use_cache_folder(folder: Path) -> None:
    """Point inductor's and triton's caches at `folder`."""
    os.environ[CACHE_ENV] = str(folder)
    os.environ[TRITON_ENV] = str(folder / "triton")


def load_artifact(
    artifacts: Callable[[], ArtifactStore],
    key: CompileKey,
    signer: ArtifactKey,
    *,
    root: Path,
    run_id: str,
) -> Loaded:
    """The journal's artifact of `key` unpacked into a new folder in `root`, when it is there,
    of this key, signed by `signer`'s key and whole; else a new empty folder, and why. Nothing
    of an artifact that fails a check is unpacked."""

    def empty(cache: CacheUse, reason: str | None, *, replaces: bool = False) -> Loaded:
        folder = Path(tempfile.mkdtemp(prefix="inductor-", dir=root))
        return Loaded(cache=cache, reason=reason, folder=folder, replaces=replaces)

    try:
        store = artifacts()
        found = store.candidates(key.model)
    except JOURNAL_ERRORS as exc:
        return empty(CacheUse.MISS, f"the journal's artifacts could not be read: {exc}")
    exact = next((a for a in found if a.key == key.key), None)
    if exact is None:
        if not found:
            return empty(CacheUse.MISS, None)
        why = f"the journal's artifact of {key.model} is not this key's: "
        return empty(CacheUse.REJECTED, why + stale_reason(key, found[0].compile_key))
    not_used = "the artifact of this key is not used: "
    if exact.compile_key != key:  # a row under this key that says it was compiled otherwise
        return empty(
            CacheUse.REJECTED, not_used + stale_reason(key, exact.compile_key), replaces=True
        )
    if exact.signature is None:
        return empty(CacheUse.REJECTED, not_used + NOT_SIGNED, replaces=True)
    if not signer.verifies(exact.signature, digest=exact.digest, key=key.key):
        return empty(CacheUse.REJECTED, not_used + BAD_SIGNATURE, replaces=True)
    try:
        data = store.read(exact)
        folder = unpack(data, parent=root)
    except ArtifactUnusable as exc:  # kept anew, in its place, after the compile
        return empty(CacheUse.REJECTED, f"{not_used}{exc}", replaces=True)
    except JOURNAL_ERRORS as exc:
        return empty(CacheUse.MISS, f"the artifact could not be read: {exc}")
    with contextlib.suppress(*JOURNAL_ERRORS):
        store.mark_used(exact.key, run_id=run_id)
    # What compiles past it is kept with it, in its place.
    return Loaded(
        cache=CacheUse.HIT, reason=None, folder=folder, artifact_bytes=len(data), replaces=True
    )
