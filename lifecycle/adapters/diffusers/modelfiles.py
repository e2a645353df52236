"""The files of a model directory, as a load would read them: every link followed, regular
files only, and never more of one read than a bound.

A FIFO opened to read waits for a writer and a device (/dev/zero) never ends, so anything
that is neither a regular file nor a directory is refused by its status before it is opened,
and what is opened is opened without blocking and checked again. Links are followed wherever
they lead (a hub snapshot's files are links into its blobs; a component folder may be a link
to another directory), except round into a folder the walk is already inside.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from lifecycle.pipelines import ConfigError

# A pipeline directory holds tens of files a few folders deep; a walk past these bounds was
# pointed at something else (a home directory), and stops in well under a second.
MAX_ENTRIES = 10_000
MAX_DEPTH = 16
_KINDS = (
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelFile:
    """A regular file of the directory, named as the directory shows it (through links)."""

    relative: str  # posix path from the directory's root, e.g. "vae/config.json"
    path: Path
    size: int


def model_files(root: Path, *, shown: str) -> tuple[ModelFile, ...]:
    """Every regular file under `root`, through links, folder by folder in name order; one
    ConfigError (`--model-path SHOWN: ...`) for a FIFO, device, socket, dangling link, link
    loop or directory cycle anywhere in it, or a tree past the bounds. Names starting with a
    dot (`.cache`, `.git`) are not the model's: neither walked nor read."""
    found: list[ModelFile] = []
    seen = 0

    def walk(folder: Path, relative: str, ancestors: dict[tuple[int, int], str]) -> None:
        nonlocal seen
        if len(ancestors) - 1 > MAX_DEPTH:  # the root is its own first ancestor
            raise _refused(shown, relative, f"is more than {MAX_DEPTH} folders deep")
        try:
            names = sorted(entry.name for entry in os.scandir(folder))
        except OSError as exc:
            raise _refused(shown, relative or ".", f"cannot be listed ({_reason(exc)})") from None
        for name in names:
            if name.startswith("."):
                continue
            seen += 1
            if seen > MAX_ENTRIES:
                raise ConfigError(
                    f"--model-path {shown}: holds more than {MAX_ENTRIES:,} files and folders:"
                    " not a pipeline directory",
                    field="model_path",
                )
            path, inner = folder / name, f"{relative}/{name}" if relative else name
            status = _status(path, shown, inner)
            if stat.S_ISDIR(status.st_mode):
                identity = (status.st_dev, status.st_ino)
                if identity in ancestors:
                    loop = ancestors[identity] or "the directory itself"
                    raise _refused(shown, inner, f"leads back to {loop} (a directory cycle)")
                walk(path, inner, {**ancestors, identity: inner})
            elif stat.S_ISREG(status.st_mode):
                found.append(ModelFile(relative=inner, path=path, size=status.st_size))
            else:
                raise _refused(shown, inner, f"is {_kind(status.st_mode)}, not a regular file")

    top = _status(root, shown, ".")
    walk(root, "", {(top.st_dev, top.st_ino): ""})
    return tuple(found)


def read_bounded(path: Path, *, limit: int) -> bytes:
    """The bytes of the regular file at `path`; OSError for anything else (a FIFO, a device)
    or for more than `limit` bytes, so that no read waits or runs on."""
    with open_regular(path) as fd:
        data = read_at(fd, 0, limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"more than {limit:,} bytes")
    return data


@contextmanager
def open_regular(path: Path) -> Iterator[int]:
    """A descriptor of the regular file at `path`, opened without waiting for a writer and
    checked after opening, should the name have been pointed elsewhere since it was walked."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"{_kind(mode)}, not a regular file")
        yield fd
    finally:
        os.close(fd)


def read_at(fd: int, offset: int, length: int) -> bytes:
    """Up to `length` bytes from `offset` (fewer at the end of the file)."""
    chunks: list[bytes] = []
    while length > 0:
        chunk = os.pread(fd, min(length, 1 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _status(path: Path, shown: str, relative: str) -> os.stat_result:
    try:
        return path.stat()
    except OSError as exc:
        if exc.errno == errno.ENOENT and path.is_symlink():
            raise _refused(shown, relative, "is a link that leads nowhere") from None
        if exc.errno == errno.ELOOP:
            raise _refused(shown, relative, "is a loop of links") from None
        raise _refused(shown, relative, f"cannot be read ({_reason(exc)})") from None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    return next((kind for is_kind, kind in _KINDS if is_kind(mode)), "an unknown kind of file")


def _refused(shown: str, relative: str, why: str) -> ConfigError:
    return ConfigError(f"--model-path {shown}: {relative} {why}", field="model_path")


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)
