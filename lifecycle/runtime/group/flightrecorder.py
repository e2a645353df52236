"""PyTorch's Flight Recorder: turned on before the process group exists, and dumped by the
rank itself on trouble, since gloo has no watchdog to do it (NCCL's also dumps on a timeout,
into the same folder)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path

from lifecycle.core.format import safepickle
from lifecycle.core.format.events import FlightRecorderDumped
from lifecycle.core.format.records import TorchGroup
from lifecycle.core.format.runid import checked_run_id, is_run_id
from lifecycle.core.settings.config import ServerArgs
from lifecycle.runtime.group.comm import EventSink

# The ring's size in entries; unset or 0 leaves the Flight Recorder off.
BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
# Each rank's dump is `<folder>/<run id>/<prefix><rank>`, the naming PyTorch's `fr_trace`
# reads; NCCL's watchdog writes its own dump beside it with its own prefix.
DUMP_PREFIX = "fr_trace_rank_"
NCCL_PREFIX = "nccl_trace_rank_"


def entries_from(env: MutableMapping[str, str]) -> int:
    """The Flight Recorder's ring size `env` asks for (0: off)."""
    try:
        return max(0, int(env.get(BUFFER_ENV, "0") or 0))
    except ValueError:
        return 0


def folder_for(args: ServerArgs, run_id: str = "") -> Path:
    """Where a run's dumps go: --flight-recorder-dir, else beside a journal file, else in the
    current folder (a fleet's journal is a database on another host); a folder per run, named
    by a run id of the one form (ConfigError otherwise), so that it is inside that folder."""
    if run_id:
        checked_run_id(run_id, source="flight recorder folder")
    return _root_for(args) / run_id


def _root_for(args: ServerArgs) -> Path:
    if args.flight_recorder_dir:
        return Path(args.flight_recorder_dir).resolve()
    journal = args.db
    if "://" not in journal or journal.startswith("sqlite:///"):
        path = Path(journal.removeprefix("sqlite:///"))
        if path.name and path.name != ":memory:":
            return path.resolve().with_name(path.name + ".flight-recorder")
    return Path("flight-recorder").resolve()


def turn_on(env: MutableMapping[str, str], *, entries: int, folder: Path) -> bool:
    """Before the process group is made: size the ring (unless `env` already does) and point
    NCCL's dump-on-timeout at `folder`. Whether the Flight Recorder is on."""
    if entries > 0:
        env.setdefault(BUFFER_ENV, str(entries))
    if entries_from(env) == 0:
        return False
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    env.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(folder / NCCL_PREFIX))
    return True


class FlightDumper:
    """Writes this rank's Flight Recorder dump on trouble, in its run's folder of the dump
    folder `root` and nowhere else, and journals where it went."""

    def __init__(
        self,
        *,
        root: Path,
        run_id: str,
        rank: int,
        sink: EventSink,
        groups: Callable[[], tuple[TorchGroup, ...]],
    ) -> None:
        self.root = root
        self.folder = root / run_id
        self.path = self.folder / f"{DUMP_PREFIX}{rank}"
        self._sink = sink
        self._groups = groups
        self._lock = threading.Lock()

    def dump(self, reason: str) -> FlightRecorderDumped:
        """Dump the ring now (atomically: a reader never sees half a dump) and journal it; a
        dump that cannot be written is journaled with why, and the rank goes on."""
        data, error = b"", None
        with self._lock:
            try:
                data = _dump_bytes()
                _write_inside(self.root, self.folder.name, self.path.name, data)
            except (OSError, RuntimeError, AttributeError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
        event = FlightRecorderDumped(
            reason=reason,
            path=None if error else str(self.path),
            host=socket.gethostname(),
            bytes=0 if error else len(data),
            entries=0 if error else _count(data),
            groups=self._groups(),
            error=error,
        )
        self._sink.record(event)
        return event


def _write_inside(root: Path, run_id: str, name: str, data: bytes) -> None:
    """Write `root/run_id/name` through a temporary name and a rename, and never outside
    `root`: `run_id` must be of the one form, and its folder, every link resolved, a folder of
    `root` itself; a link planted at the temporary name is not followed. PermissionError
    otherwise, which the dump journals."""
    real_root = root.resolve()
    folder = real_root / run_id
    if not is_run_id(run_id):
        raise PermissionError(f"{run_id[:80]!r} is not a run id: no dump written under {root}")
    folder.mkdir(parents=True, exist_ok=True)
    if folder.resolve() != folder:
        raise PermissionError(f"{folder} leads outside {real_root}: no dump written")
    part = folder / f"{name}.part"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    with os.fdopen(os.open(part, flags, 0o644), "wb") as out:
        out.write(data)
    os.replace(part, folder / name)


def _dump_bytes() -> bytes:
    """The Flight Recorder's pickled dump: every entry, with its Python stack."""
    import torch._C._distributed_c10d as c10d  # the only way to it: no public API yet

    data: bytes = c10d._dump_fr_trace(True, True, False)  # type: ignore[attr-defined]
    return data


def _count(data: bytes) -> int:
    """How many entries a dump holds."""
    with contextlib.suppress(safepickle.UnsafePickle, AttributeError, TypeError):
        return len(safepickle.loads(data).get("entries", ()))
    return 0
