"""The Flight Recorder dump files that retention may remove with a journal's runs.

A journal's rows are not proof that it wrote the files they name: `lifecycle db copy` carries a
node's `flight_recorder_dumped` rows into the fleet's journal, and a hand-made or damaged
journal may name anything. A dump file goes with its run only when all of these hold:

- the run id is of the one form (`lifecycle.core.format.runid`), so that a folder named for it is
  one folder, under its parent;
- the run's config shows that its ranks journaled into this very journal, and where they put
  their dumps: an absolute `--flight-recorder-dir`, with `db` naming this journal by its
  absolute path or its URL; or, by default, beside this journal file, in
  `JOURNAL.flight-recorder/RUN_ID/` (named for the file the ranks resolved, which a copy
  elsewhere does not share);
- a dump row of the run names this host, and an absolute path whose real path lies in that
  folder (no `..`, no link out of it; a relative path is not resolved against whatever the
  working directory now is).

What goes is then the regular files of that folder named as a rank or NCCL's watchdog names a
dump (links are left alone), and the folder once empty.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Text, select, type_coerce
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from lifecycle.core.format.runid import is_run_id
from lifecycle.store.backends.schema import events, runs
from lifecycle.store.location import is_url, sqlite_file
from lifecycle.store.rows import json_column

DUMP_NAME = re.compile(r"(fr|nccl)_trace_rank_[0-9]+(\.part)?")
FOLDER_SUFFIX = ".flight-recorder"  # a journal file's default dump folder: JOURNAL + this
RUNS_PER_QUERY = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class ThisJournal:
    """This journal as a run's config may name it: its file (real path), or its server URL
    reduced to what identifies the database (no driver, no password)."""

    file: Path | None
    server: tuple[str, str | None, str | None, int | None, str | None] | None

    @classmethod
    def at(cls, url: str) -> ThisJournal:
        """This journal, from the SQLAlchemy URL it was opened with."""
        path = sqlite_file(make_url(url))
        if path is not None:
            return cls(file=Path(os.path.realpath(path)), server=None)
        return cls(file=None, server=_server(url))

    def named_by(self, db: str) -> bool | None:
        """Whether a run's `db` names this journal; None for a relative path, which the ranks
        resolved against a working directory that no row records."""
        if is_url(db) and not db.startswith("sqlite:///"):
            return self.server is not None and _server(db) == self.server
        path = db.removeprefix("sqlite:///")
        if self.file is None:
            return False
        if not os.path.isabs(path):
            return None
        return Path(os.path.realpath(path)) == self.file

    def run_folder(self, run_id: str, config: Mapping[str, Any]) -> Path | None:
        """Where the ranks of run `run_id` put their dumps, when its config shows that they
        journaled into this journal and says where; None otherwise."""
        db, chosen = config.get("db"), config.get("flight_recorder_dir")
        if not is_run_id(run_id) or not isinstance(db, str):
            return None
        if chosen is not None:
            # Resolved by the ranks against their working directory: only an absolute folder
            # is known here, and only the run's own journal may say it is its.
            if not isinstance(chosen, str) or not os.path.isabs(chosen):
                return None
            return Path(chosen) / run_id if self.named_by(db) else None
        # By default the folder is named for the journal file the ranks resolved, so a dump
        # in this file's folder was written by ranks journaling into this file; a `db` naming
        # another file (the node's, for a copy) is not this journal.
        if self.file is None or self.named_by(db) is False:
            return None
        return self.file.with_name(self.file.name + FOLDER_SUFFIX) / run_id


def _server(url: str) -> tuple[str, str | None, str | None, int | None, str | None] | None:
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        return None
    backend = parsed.drivername.split("+", 1)[0]
    return backend, parsed.username, parsed.host, parsed.port, parsed.database


def find_dumps(
    conn: Connection, run_ids: Sequence[str], journal: ThisJournal, *, host: str | None = None
) -> list[Path]:
    """The dump files of `run_ids` that this journal's ranks wrote on `host` (this host by
    default), as the module's docstring says."""
    host = socket.gethostname() if host is None else host
    found: set[Path] = set()
    for start in range(0, len(run_ids), RUNS_PER_QUERY):
        chunk = list(run_ids[start : start + RUNS_PER_QUERY])
        folders = {}
        for run_id, config in conn.execute(
            select(runs.c.run_id, type_coerce(runs.c.config, Text)).where(runs.c.run_id.in_(chunk))
        ):
            folder = journal.run_folder(run_id, _json_object(config))
            if folder is not None:
                folders[run_id] = Path(os.path.realpath(folder))
        rows = conn.execute(
            select(events.c.run_id, type_coerce(events.c.data, Text)).where(
                events.c.run_id.in_(list(folders)), events.c.kind == "flight_recorder_dumped"
            )
        )
        for run_id, data in rows:
            dumped = _json_object(data)
            folder = folders[run_id]
            if folder not in found and dumped.get("host") == host and _inside(dumped, folder):
                found.add(folder)
    return sorted(path for folder in found for path in _dump_files(folder))


def _inside(dumped: Mapping[str, Any], folder: Path) -> bool:
    """Whether a dump row names a dump file in `folder` (a real path)."""
    path = dumped.get("path")
    if not isinstance(path, str) or not os.path.isabs(path):
        return False
    named = Path(os.path.realpath(path))
    return named.parent == folder and DUMP_NAME.fullmatch(named.name) is not None


def _dump_files(folder: Path) -> Iterator[Path]:
    """The regular files in `folder` named as dumps are (a link is not followed, nor removed)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        with contextlib.suppress(OSError):
            if DUMP_NAME.fullmatch(entry.name) and stat.S_ISREG(
                entry.stat(follow_symlinks=False).st_mode
            ):
                yield Path(entry.path)


def remove_dumps(paths: Sequence[Path]) -> int:
    """Remove `paths`, then each folder they were in once it is empty; how many went."""
    removed = 0
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
            removed += 1
    for folder in {path.parent for path in paths}:
        with contextlib.suppress(OSError):
            folder.rmdir()  # only once empty
    return removed


def _json_object(value: object) -> dict[str, Any]:
    """A JSON object column's value as a dict; {} for anything else."""
    if isinstance(value, str):
        value = json_column(value)
    return value if isinstance(value, dict) else {}
