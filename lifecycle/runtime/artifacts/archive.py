"""A compiler cache folder as an artifact's bytes (a gzip'd tar), and those bytes unpacked
again: only regular files and folders, under relative names that stay inside, into a folder
made fresh for them, within bounds on what they unpack to. Tar's own extraction is not used:
its `data` filter resolves links with `os.path.realpath`, which a chain of links past PATH_MAX
defeats (CVE-2025-4517); nothing here ever makes a link, so nothing can be written through one."""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath
from typing import IO

from lifecycle.core.decisions.compiling import MAX_ARTIFACT_BYTES
from lifecycle.store.learned.artifactfiles import ArtifactUnusable

# What an artifact may unpack to: 64 times its packed size (a compiler's cache of code and
# kernels packs a few times smaller; a bomb of zeros a thousand times), at least 64 MiB and at
# most 4 GiB (four times the largest artifact kept); and at most this many files (a large
# model's cache holds a few thousand).
UNPACK_RATIO = 64
MIN_UNPACKED_BOUND = 64 << 20
MAX_UNPACKED_BOUND = 4 * MAX_ARTIFACT_BYTES
MAX_UNPACKED_FILES = 20_000
_CHUNK = 1 << 20
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What a tar member that is neither a regular file nor a folder is, in words.
_MEMBER_KINDS = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a FIFO",
}


def unpacked_bound(packed: int) -> int:
    """The most bytes an artifact of `packed` bytes may unpack to."""
    return min(MAX_UNPACKED_BOUND, max(MIN_UNPACKED_BOUND, UNPACK_RATIO * packed))


def pack(folder: Path) -> bytes:
    """The regular files under `folder` (lock files, which come and go, left out), as a gzip'd
    tar of names relative to it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for path in sorted(folder.rglob("*")):
            if stat.S_ISREG(path.lstat().st_mode) and not path.name.endswith(".lock"):
                archive.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


def unpack(data: bytes, *, parent: Path) -> Path:
    """Unpack an artifact into a new folder (mode 0700) inside `parent`, and return it; on
    anything it refuses (a link, a device, a name that leaves the folder, more than its bounds,
    bytes that do not unpack), ArtifactUnusable in one line, and nothing of it is left."""
    folder = Path(tempfile.mkdtemp(prefix="inductor-", dir=parent))
    try:
        _extract(data, folder)
    except ArtifactUnusable:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    except (tarfile.TarError, OSError, EOFError, ValueError, zlib.error) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ArtifactUnusable(f"it does not unpack: {exc}") from None
    return folder


class _Bounded(io.RawIOBase):
    """What a stream decompresses to, refused past `limit` bytes."""

    def __init__(self, stream: gzip.GzipFile, limit: int) -> None:
        self._stream = stream
        self._left = limit
        self._limit = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        got = self._stream.readinto(buffer)
        self._left -= got
        if self._left < 0:
            raise ArtifactUnusable(f"it unpacks to more than {self._limit:,} bytes")
        return got


def _extract(data: bytes, folder: Path) -> None:
    bound = unpacked_bound(len(data))
    # The tar's own headers and padding come on top of the files' bytes.
    stream = _Bounded(
        gzip.GzipFile(fileobj=io.BytesIO(data)), bound + (MAX_UNPACKED_FILES + 2) * 1024
    )
    written = members = 0
    with tarfile.open(fileobj=io.BufferedReader(stream, _CHUNK), mode="r|") as archive:
        for member in archive:
            members += 1
            if members > MAX_UNPACKED_FILES:
                raise ArtifactUnusable(
                    f"it holds more than {MAX_UNPACKED_FILES:,} files and folders"
                )
            target = folder.joinpath(*_parts(member.name))
            if member.isdir():
                target.mkdir(mode=0o700, parents=True, exist_ok=True)
                continue
            if not member.isreg():
                kind = _MEMBER_KINDS.get(member.type, f"of tar type {member.type!r}")
                raise ArtifactUnusable(
                    f"{member.name[:200]!r} is {kind}, not a regular file or folder"
                )
            written += member.size
            if written > bound:
                raise ArtifactUnusable(f"it unpacks to more than {bound:,} bytes")
            source = archive.extractfile(member)
            assert source is not None  # a regular file's member
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            _write(target, source, member.size)


def _parts(name: str) -> tuple[str, ...]:
    """The folders and file of a member's name, each a plain name: never absolute, empty, `..`
    or holding a NUL."""
    parts = tuple(p for p in PurePosixPath(name).parts if p != ".")
    if not parts or name.startswith("/") or any(p in ("..", "") or "\0" in p for p in parts):
        raise ArtifactUnusable(f"{name[:200]!r} is not a relative name inside the folder")
    return parts


def _write(target: Path, source: IO[bytes], size: int) -> None:
    """Write exactly `size` bytes of `source` to a file that did not exist (never through a
    link: only this loop writes in the folder, and it makes none)."""
    fd = os.open(target, _FILE_FLAGS, 0o600)
    with contextlib.closing(source), open(fd, "wb", closefd=True) as out:
        left = size
        while left > 0:
            chunk = source.read(min(left, _CHUNK))
            if not chunk:
                raise ArtifactUnusable(f"{target.name!r} is cut short")
            out.write(chunk)
            left -= len(chunk)
