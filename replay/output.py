"""Where `replay trace -o` may write: a regular or new file, never a journal being read, written
through a temporary file renamed into place."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lifecycle.store.location import file_identity, journal_files
from lifecycle.store.regularfile import other_file_kind
from replay.exits import ReplayError


class OutputRefused(ReplayError):
    """`trace -o` names a file that replay will not write."""

    def __init__(self, *, output: str, reason: str) -> None:
        super().__init__(f"-o {output} {reason}")
        self.output = output
        self.reason = reason


def trace_target(output: str, journals: Sequence[str]) -> Path:
    """The file `trace -o` may replace: a regular file or a new path in a writable directory,
    never a file of a journal being read, however it is named (link, URL, relative path)."""
    named = Path(os.path.expanduser(output))
    target = Path(os.path.realpath(named))
    try:
        # Through every link, to what a write would reach (a pipe behind /dev/stdout too).
        status: os.stat_result | None = named.stat()
    except FileNotFoundError:
        status = None
    except OSError as exc:
        raise OutputRefused(output=output, reason=f"cannot be examined: {_reason(exc)}") from None
    if status is not None:
        kind = other_file_kind(status.st_mode)
        if kind is not None or not stat.S_ISREG(status.st_mode):
            raise OutputRefused(
                output=output,
                reason=f"is {kind or 'not a regular file'}; give a file to write, or - for stdout",
            )
        mine = (status.st_dev, status.st_ino)
        for journal in journals:
            if any(file_identity(f) == mine for f in journal_files(journal)):
                raise OutputRefused(
                    output=output,
                    reason=f"is one of the journals being read ({journal}); choose another file",
                )
    else:
        # A new path may still be a journal's sidecar that does not exist right now.
        for journal in journals:
            if any(Path(os.path.realpath(f)) == target for f in journal_files(journal)):
                raise OutputRefused(
                    output=output,
                    reason=f"is a file of a journal being read ({journal}); choose another file",
                )
    if not target.parent.is_dir():
        raise OutputRefused(output=output, reason=f"is in {target.parent}, which does not exist")
    return target


def write_replacing(target: Path, trace: object, *, output: str) -> None:
    """Write to a new file beside `target` and rename it into place, so that a reader never
    sees half a trace and a failed write leaves the old file as it was."""
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        fd, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"
        )
    except OSError as exc:
        raise OutputRefused(output=output, reason=f"cannot be written: {_reason(exc)}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(trace, fh)
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise OutputRefused(output=output, reason=f"cannot be written: {_reason(exc)}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _reason(exc: OSError) -> str:
    return os.strerror(exc.errno).lower() if exc.errno else str(exc)
