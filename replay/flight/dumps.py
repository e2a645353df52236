"""PyTorch Flight Recorder dumps, read: the pickled form (through `safepickle`, which builds
plain data only and never unpickles) and the JSON form, one file per rank."""

from __future__ import annotations

import itertools
import json
import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lifecycle.core.format import safepickle
from lifecycle.core.format.runid import is_run_id
from lifecycle.core.format.view import RankView
from lifecycle.store.regularfile import RefusedFile, read_regular

# The dump layout this replay reads: version "2.x" (torch 2.13 writes "2.10").
MAJOR_VERSION = 2
# What one dump may be: its size on disk, the entries in it, how deep its values nest, and
# what it expands to with every shared (memoized) value counted as a copy.
MAX_DUMP_BYTES = 256 << 20
MAX_ENTRIES = 1 << 20
MAX_DEPTH = safepickle.MAX_DEPTH
MAX_EXPANDED_BYTES = 512 << 20
# Text kept from a dump (an op, a group's name, a frame's file or function): a ring's worth of
# it is held at once, and printed.
MAX_TEXT = 300
# A dump's rank is the number its file name ends with, as PyTorch's fr_trace reads it
# (`fr_trace_rank_3`, `nccl_trace_rank_3`, `rank3.json`).
_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle))?$")
_FRAMES_KEPT = 6
# Frames inside torch.distributed say nothing of who called the collective.
_TORCH_FRAMES = ("torch/distributed/", "torch\\distributed\\")
# JSON strings, whose brackets are text, and every byte but a bracket.
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# What a JSON container and a value in one take once parsed, as safepickle counts them.
_JSON_CONTAINER = 64
_JSON_VALUE = 40


class BadDump(ValueError):
    """A file that is not a Flight Recorder dump this replay reads: why, in one line."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightEntry:
    """One collective (or point-to-point op) in a rank's Flight Recorder ring."""

    record_id: int
    pg_name: str  # torch's name for the process group: "0" is the default group
    pg_desc: str
    seq: int  # the group's collective sequence number (its p2p one for a p2p op)
    is_p2p: bool
    op: str  # without the backend's prefix: all_reduce, allgather, ...
    input_sizes: tuple[tuple[int, ...], ...]
    output_sizes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    created_s: float  # the rank's own wall clock, when the op was enqueued
    started_s: float | None
    completed_s: float | None
    state: str  # scheduled, started or completed (gloo only ever says scheduled)
    retired: bool  # the work finished, as far as the recorder knows
    timeout_s: float | None
    frames: tuple[str, ...]  # "file:line function", innermost first

    @property
    def finished(self) -> bool:
        return self.retired or self.state == "completed"

    @property
    def caller(self) -> str | None:
        """The innermost frame outside torch.distributed, "file.py:line function": the code
        that issued the collective."""
        for frame in self.frames:
            if not any(part in frame for part in _TORCH_FRAMES):
                path, _, rest = frame.partition(":")
                return f"{path.replace(chr(92), '/').rsplit('/', 1)[-1]}:{rest}"
        return None

    @property
    def group_label(self) -> str:
        """The process group as a person tells it: its description, else "pg NAME"."""
        desc = self.pg_desc
        return desc if desc and desc != "undefined" else f"pg {self.pg_name}"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightDump:
    rank: int
    paths: tuple[str, ...]  # the files it was read from, merged by record id
    version: str
    entries: tuple[FlightEntry, ...]  # by record id
    # Members of each process group, where the dump names them (NCCL does; gloo does not).
    pg_ranks: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


def rank_of(path: Path) -> int | None:
    found = _RANK_IN_NAME.search(path.name)
    return int(found.group(1)) if found else None


def parse(data: bytes, *, rank: int, path: str) -> FlightDump:
    """One rank's dump from its bytes; BadDump says what is wrong with it."""
    # replay.views.render reaches this module through the verdict it renders: imported when used.
    from lifecycle.core.format.text import clean

    def text(value: Any) -> str:
        """Text of a dump as replay holds it: cut short, then cleaned of escape sequences and
        control characters as journal text is, so that a dump cannot write to the terminal."""
        if not isinstance(value, str | int | float):
            raise TypeError(f"expected text, not {type(value).__name__}")
        return clean(value[:MAX_TEXT] if isinstance(value, str) else str(value))

    if len(data) > MAX_DUMP_BYTES:
        raise BadDump(f"{path}: {len(data)} bytes, more than a dump holds")
    start = data.lstrip()[:1]
    if start not in (b"{", b"\x80"):
        raise BadDump(f"{path}: not a Flight Recorder dump (neither JSON nor a pickle)")
    try:
        raw: Any = (
            _json(data)
            if start == b"{"
            else safepickle.loads(data, max_depth=MAX_DEPTH, max_bytes=MAX_EXPANDED_BYTES)
        )
    except ValueError as exc:  # UnsafePickle, JSONDecodeError, UnicodeDecodeError
        raise BadDump(f"{path}: not a Flight Recorder dump ({_first_line(exc)})") from None
    if not isinstance(raw, dict) or "entries" not in raw or "version" not in raw:
        raise BadDump(f"{path}: not a Flight Recorder dump (no version and entries)")
    try:
        version = text(raw["version"])
    except (TypeError, ValueError):
        raise BadDump(f"{path}: not a Flight Recorder dump (its version is not text)") from None
    major = version.split(".", maxsplit=1)[0]
    if major != str(MAJOR_VERSION):
        raise BadDump(
            f"{path}: Flight Recorder dump version {version}; this replay reads {MAJOR_VERSION}.x"
        )
    entries = raw["entries"]
    if not isinstance(entries, list):
        raise BadDump(f"{path}: not a Flight Recorder dump (entries is not a list)")
    if len(entries) > MAX_ENTRIES:
        raise BadDump(f"{path}: {len(entries)} entries, more than the {MAX_ENTRIES} replay reads")
    parsed = []
    for index, entry in enumerate(entries):
        try:
            parsed.append(_entry(entry, text))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise BadDump(
                f"{path}: entry {index} is not a Flight Recorder entry ({_first_line(exc)})"
            ) from None
    return FlightDump(
        rank=rank,
        paths=(clean(path),),
        version=version,
        entries=tuple(sorted(parsed, key=lambda e: e.record_id)),
        pg_ranks=_pg_ranks(raw.get("pg_config"), text),
    )


def _json(data: bytes | str) -> Any:
    """JSON in UTF-8, refused before it is parsed unless it nests MAX_DEPTH levels at most
    (json's parser recurses once a level, as does anything that walks what it builds) and
    builds MAX_EXPANDED_BYTES at most (two bytes of `[]` are a list of 56)."""
    raw = data.encode() if isinstance(data, str) else data
    # UTF-8 puts no byte of a longer character in ASCII: brackets and commas are bytes.
    outside = _JSON_STRING.sub(b"", raw)
    steps = outside.translate(_BRACKET_STEPS, _NOT_BRACKETS)  # +1 opening, -1 closing
    built = _JSON_CONTAINER * steps.count(1) + _JSON_VALUE * outside.count(b",") + len(raw)
    if built > MAX_EXPANDED_BYTES:
        raise ValueError(f"refused: it expands to more than {MAX_EXPANDED_BYTES} bytes")
    if max(itertools.accumulate(memoryview(steps).cast("b")), default=0) > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    return json.loads(raw.decode("utf-8"))


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _sizes(value: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(n) for n in shape) for shape in value or ())


def _ns(value: Any) -> float | None:
    return None if not value else int(value) / 1e9


def _entry(raw: Any, text: Callable[[Any], str]) -> FlightEntry:
    if not isinstance(raw, dict):
        raise TypeError("not a mapping")
    group = raw["process_group"]
    is_p2p = bool(raw.get("is_p2p", False))
    timeout_ms = raw.get("timeout_ms")
    frames = tuple(
        f"{text(f['filename'])}:{text(f['line'])} {text(f['name'])}"
        for f in (raw.get("frames") or ())[:_FRAMES_KEPT]
        if isinstance(f, dict)
    )
    return FlightEntry(
        record_id=int(raw["record_id"]),
        pg_name=text(group[0]),
        pg_desc=text(group[1]) if len(group) > 1 else "",
        seq=int(raw["p2p_seq_id"] if is_p2p else raw["collective_seq_id"]),
        is_p2p=is_p2p,
        op=text(raw["profiling_name"]).split(":", 1)[-1],
        input_sizes=_sizes(raw.get("input_sizes")),
        output_sizes=_sizes(raw.get("output_sizes")),
        dtypes=tuple(text(d) for d in raw.get("input_dtypes") or ()),
        created_s=int(raw["time_created_ns"]) / 1e9,
        started_s=_ns(raw.get("time_discovered_started_ns")),
        completed_s=_ns(raw.get("time_discovered_completed_ns")),
        state=text(raw.get("state", "scheduled")),
        retired=bool(raw.get("retired", False)),
        timeout_s=None if timeout_ms is None else int(timeout_ms) / 1000,
        frames=frames,
    )


def _pg_ranks(config: Any, text: Callable[[Any], str]) -> dict[str, tuple[int, ...]]:
    """Each process group's members from the dump's pg_config, where it lists them."""
    found: dict[str, tuple[int, ...]] = {}
    if not isinstance(config, dict):
        return found
    for name, entry in config.items():
        ranks = entry.get("ranks") if isinstance(entry, dict) else None
        if isinstance(ranks, str):
            try:
                ranks = _json(ranks)
            except ValueError:
                continue
        if isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks):
            try:
                found[text(name)] = tuple(ranks)
            except (TypeError, ValueError):
                continue
    return found


def merge(dumps: Iterable[FlightDump]) -> FlightDump:
    """One rank's dumps as one: entries by record id, a later dump's word winning."""
    ordered = sorted(dumps, key=lambda d: max((e.record_id for e in d.entries), default=-1))
    entries: dict[int, FlightEntry] = {}
    pg_ranks: dict[str, tuple[int, ...]] = {}
    for dump in ordered:
        entries.update((e.record_id, e) for e in dump.entries)
        pg_ranks.update(dump.pg_ranks)
    last = ordered[-1]
    return FlightDump(
        rank=last.rank,
        paths=tuple(p for d in ordered for p in d.paths),
        version=last.version,
        entries=tuple(entries[k] for k in sorted(entries)),
        pg_ranks=pg_ranks,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class FlightDumps:
    """The dumps of one run, by rank, and the files that could not be read (one line each)."""

    by_rank: Mapping[int, FlightDump]
    problems: tuple[str, ...] = ()


def read_files(paths: Iterable[tuple[Path, int | None]]) -> FlightDumps:
    """Read each (file, rank) — the rank from its name where None — and merge by rank; a file
    that cannot be read is set aside with why."""
    found: dict[int, list[FlightDump]] = {}
    problems: list[str] = []
    seen: set[Path] = set()
    for path, given in paths:
        if path in seen:
            continue
        seen.add(path)
        rank = given if given is not None else rank_of(path)
        if rank is None:
            problems.append(f"{path}: no rank number at the end of its name")
            continue
        try:
            data = read_regular(path, limit=MAX_DUMP_BYTES)
            dump = parse(data, rank=rank, path=str(path))
            found.setdefault(rank, []).append(dump)
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
        except RefusedFile as exc:
            problems.append(f"{path}: {exc}")
        except BadDump as exc:
            problems.append(str(exc))
    return FlightDumps(
        by_rank={rank: merge(dumps) for rank, dumps in sorted(found.items())},
        problems=tuple(problems),
    )


def files_in(folder: Path, run_id: str) -> list[Path]:
    """The dump files in `folder`, or in its subfolder named for the run when it has one. Only
    a run id of the one form is made part of a path: a journal may come from anywhere, and
    `../..` or `/etc` is no subfolder of a run."""
    if is_run_id(run_id) and (folder / run_id).is_dir():
        folder = folder / run_id
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.endswith(".part") and rank_of(p) is not None
    )


def dumps_for(
    run_id: str, views: Mapping[int, RankView], folder: Path | None
) -> FlightDumps | None:
    """A run's dumps: every dump file in `folder` (or its subfolder for the run), else the
    files the ranks journaled writing and the others beside them (NCCL's watchdog's own);
    None when the run has none and no folder is given."""
    if folder is not None:
        try:
            return read_files((path, None) for path in files_in(folder, run_id))
        except OSError as exc:
            return FlightDumps(by_rank={}, problems=(f"{folder}: {exc.strerror or exc}",))
    paths: list[tuple[Path, int | None]] = []
    problems: list[str] = []
    for rank, view in sorted(views.items()):
        journaled = [(at, d) for at, _, d in view.flight_dumps]
        for _, dumped in journaled:
            if dumped.path is None:
                problems.append(f"rank {rank} could not dump its Flight Recorder: {dumped.error}")
        written = [d for _, d in journaled if d.path is not None]
        if not written:
            continue
        last = Path(written[-1].path or "")
        # A path a row names is followed only to a regular file, and its folder read only then.
        try:
            status: os.stat_result | None = last.stat()
        except (OSError, ValueError):
            status = None
        if status is None or not stat.S_ISREG(status.st_mode):
            where = "is not here" if status is None else "is not a regular file"
            problems.append(
                f"rank {rank}'s Flight Recorder dump {last} (host {written[-1].host}) {where}:"
                " give the folder with --flight-recorder DIR"
            )
            continue
        try:
            paths.extend((p, rank_of(p)) for p in files_in(last.parent, run_id))
        except OSError as exc:
            problems.append(f"{last.parent}: {exc.strerror or exc}")
    if not paths and not problems:
        return None
    found = read_files(paths)
    return FlightDumps(by_rank=found.by_rank, problems=(*problems, *found.problems))
