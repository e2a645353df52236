"""The compiler's artifacts as files beside a SQLite journal (`JOURNAL.compile-cache/DIGEST`):
written whole under a temporary name and renamed into place, read only when a regular file, and
removed without a file that will not go ever stopping the startup or the upkeep that meets it."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from lifecycle.core.decisions.compiling import MAX_ARTIFACT_BYTES, is_digest
from lifecycle.store.regularfile import RefusedFile, read_regular

TEMPORARY_PREFIX = ".part-"


class ArtifactUnusable(Exception):
    """A stored artifact that is not loaded, and why (one line)."""


def read_file(path: Path) -> bytes:
    """An artifact's file, when it is a regular file (a FIFO would hold the read until a writer
    came; a link leads elsewhere); ArtifactUnusable otherwise."""
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise ArtifactUnusable(f"{path}: a symbolic link, not a regular file")
        return read_regular(path, limit=MAX_ARTIFACT_BYTES)
    except RefusedFile as exc:
        raise ArtifactUnusable(f"{path}: {exc}") from None
    except OSError as exc:
        raise ArtifactUnusable(f"{path}: {exc.strerror or exc}") from None


def write_file(folder: Path, digest: str, data: bytes) -> None:
    """`data` as the file `digest` in `folder`, renamed into place whole (OSError where it
    cannot be); a regular file of its size there already is the same bytes, by their digest."""
    folder.mkdir(mode=0o700, exist_ok=True)
    target = folder / digest
    with contextlib.suppress(OSError):
        status = os.lstat(target)
        if stat.S_ISREG(status.st_mode) and status.st_size == len(data):
            os.utime(target)  # new again to `db prune`, which spares the files of a keep
            return
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=TEMPORARY_PREFIX)
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


def stale_files(folder: Path, *, before: float) -> tuple[list[str], list[str]]:
    """The entries in `folder` named like a digest or a keep's temporary file, last changed
    before `before`, that are not folders (a FIFO or a link at such a name is removed as a file
    is: unlinked, never opened or followed); and a line for each folder at such a name, which
    is left as it is, and for a folder that cannot be listed."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        return [], [f"{folder}: {exc.strerror or exc}"]
    stale, left = [], []
    for name in names:
        if not (is_digest(name) or name.startswith(TEMPORARY_PREFIX)):
            continue
        try:
            status = os.lstat(folder / name)
        except OSError:
            continue
        if stat.S_ISDIR(status.st_mode):
            left.append(f"{folder / name}: a directory, not a regular file")
        elif status.st_mtime < before:
            stale.append(name)
    return stale, left


def remove_named(folder: Path, names: list[str]) -> tuple[int, list[str]]:
    """Remove the files `names` in `folder`: how many went, and a line for each that could not
    (a directory at its name, a folder this process may not write), which is left as it is."""
    removed, left = 0, []
    for name in dict.fromkeys(names):
        path = folder / name
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                left.append(f"{path}: a directory, not a regular file")
                continue
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append(f"{path}: {exc.strerror or exc}")
    return removed, left
