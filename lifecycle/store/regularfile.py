"""Files named from outside the journal (a config file, a Flight Recorder dump) read safely: a
regular file only, and never more of it than a bound."""

from __future__ import annotations

import os
import stat

_CHUNK = 1 << 20
FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def other_file_kind(mode: int) -> str | None:
    """What a file of `mode` is when it is one of the kinds above, in words; else None."""
    return next((kind for is_kind, kind in FILE_KINDS if is_kind(mode)), None)


class RefusedFile(ValueError):
    """A file that is not read: not a regular file, or larger than the bound; why, in a few
    words ("a FIFO, not a regular file")."""


def read_regular(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them; RefusedFile for
    anything else, OSError where it cannot be opened or read.

    A FIFO, a device or a socket is refused by its status before it is opened (opening a
    FIFO to read waits for a writer; /dev/zero never ends), and what was opened is checked
    again, should the name have been pointed elsewhere in between."""
    try:
        status = os.stat(path)
    except ValueError:  # a NUL byte in the name
        raise RefusedFile("not a file name") from None
    _check(status, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check(os.fstat(fd), limit)
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, _CHUNK))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    if left <= 0:  # it grew while it was read
        raise RefusedFile(f"more than {limit} bytes")
    return b"".join(chunks)


def _check(status: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(status.st_mode):
        kind = other_file_kind(status.st_mode) or "something"
        raise RefusedFile(f"{kind}, not a regular file")
    if status.st_size > limit:
        raise RefusedFile(f"{status.st_size} bytes, more than {limit}")
