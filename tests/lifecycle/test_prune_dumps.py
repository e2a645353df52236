"""Retention of Flight Recorder dumps: `lifecycle db prune` removes the dump files a removed
run's ranks wrote on this host into the journal's own dump folder, and never a file that a
copied, foreign or crafted row names."""

from __future__ import annotations

import json
import socket
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Completed, file_digest
from tests.lifecycle.test_prune import (
    DAY,
    NOW,
    Run,
    aged,
    build_journal,
    prune,
    run_ids_in,
    settle,
)

HOST = socket.gethostname()
DUMP_NAMES = ("fr_trace_rank_0", "fr_trace_rank_1", "nccl_trace_rank_1")


def dumps_in(folder: Path, names: tuple[str, ...] = DUMP_NAMES) -> list[Path]:
    """Dump files in `folder`, as ranks (and NCCL's watchdog) leave them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"dump")
    return [folder / name for name in names]


def journal_dumps(db: Path, *rows: tuple[str, str], host: str = HOST) -> None:
    """A `flight_recorder_dumped` row on rank 0 of each (run id, path) in `rows`."""
    with sqlite3.connect(db) as conn:
        for run_id, path in rows:
            data = {"reason": "stall", "path": path, "host": host, "bytes": 4, "entries": 1,
                    "groups": [], "error": None}  # fmt: skip
            conn.execute(
                "INSERT INTO events (run_id, rank, seq, wall_time, mono_ns, kind, version, state,"
                " data) SELECT ?, 0, coalesce(max(seq), -1) + 1, ?, 0, 'flight_recorder_dumped',"
                " 1, 'failed', ? FROM events WHERE run_id = ? AND rank = 0",
                (run_id, NOW - 40 * DAY, json.dumps(data), run_id),
            )
    settle(db)


def journal_in(folder: Path, *runs: Run) -> Path:
    """A journal `j.db` in `folder` (made), holding `runs`."""
    folder.mkdir(parents=True)
    return build_journal(folder / "j.db", *runs)


def node_with_dumps(tmp_path: Path, **config: object) -> tuple[Path, dict[str, list[Path]]]:
    """A node's journal of three runs, the two older ones each with three dump files it
    journaled writing into its default folder (or `flight_recorder_dir` of `config`)."""
    db = tmp_path / "node" / "node.db"
    db.parent.mkdir()
    run_config = {"db": str(db), **config}
    build_journal(
        db, *(aged(r, d, config=run_config) for r, d in (("r1", 50), ("r2", 40), ("r3", 30)))
    )
    chosen = config.get("flight_recorder_dir")
    base = Path(str(chosen)) if chosen else db.with_name("node.db.flight-recorder")
    files = {run_id: dumps_in(base / run_id) for run_id in ("r1", "r2")}
    journal_dumps(db, *((run_id, str(paths[0])) for run_id, paths in files.items()))
    return db, files


def test_a_removed_runs_dumps_go_with_it_and_nothing_else(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """The dump files a removed run journaled writing on this host (and NCCL's beside them) are
    removed with it, and its folder once empty; another file in that folder, a file of a kept
    run, and a dump elsewhere that a row names stay."""
    db, _ = node_with_dumps(tmp_path)
    flight = db.with_name("node.db.flight-recorder")
    (flight / "r2" / "notes.txt").write_text("kept")
    kept = dumps_in(flight / "r3")
    journal_dumps(db, ("r3", str(kept[0])))
    elsewhere = dumps_in(tmp_path / "other" / "r1", ("fr_trace_rank_0",))
    journal_dumps(db, ("r1", str(elsewhere[0])))
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert "removed 2 runs (15 events, 6 Flight Recorder dump file(s))" in result.stdout
    assert not (flight / "r1").exists()
    assert sorted(p.name for p in (flight / "r2").iterdir()) == ["notes.txt"]
    assert all(path.exists() for path in [*kept, *elsewhere])


def test_pruning_a_copy_leaves_the_dumps_of_the_journal_its_ranks_wrote(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A node's journal copied into a fleet file beside it: pruning the copy removes its runs'
    rows, and none of the dump files the node's ranks wrote, which its rows name."""
    node, files = node_with_dumps(tmp_path)
    fleet = tmp_path / "node" / "fleet.db"
    copied = lifecycle_cli("db", "copy", "--db", str(node), "--to", str(fleet), timeout=120)
    assert copied.returncode == 0, copied.stderr
    result = prune(lifecycle_cli, fleet, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{fleet}: removed 2 runs (14 events) beyond the 1 newest; kept 1\n"
    assert run_ids_in(fleet) == {"r3"}
    assert all(path.read_bytes() == b"dump" for paths in files.values() for path in paths)


def test_dumps_in_a_chosen_folder_go_only_with_the_journal_its_ranks_wrote(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """With --flight-recorder-dir, pruning a copy of the node's journal leaves the dumps;
    pruning the node's journal itself, which its runs name as their `db`, removes them."""
    node, files = node_with_dumps(tmp_path, flight_recorder_dir=str(tmp_path / "dumps"))
    fleet = tmp_path / "fleet.db"
    assert lifecycle_cli("db", "copy", "--db", str(node), "--to", str(fleet)).returncode == 0
    from_copy = prune(lifecycle_cli, fleet, "--keep-runs", "1", "--now", str(NOW))
    assert from_copy.returncode == 0, from_copy.stderr
    assert all(path.exists() for paths in files.values() for path in paths)
    from_node = prune(lifecycle_cli, node, "--keep-runs", "1", "--now", str(NOW))
    assert from_node.returncode == 0, from_node.stderr
    assert "6 Flight Recorder dump file(s)" in from_node.stdout
    assert not any(path.exists() for paths in files.values() for path in paths)


def test_a_dry_run_counts_and_lists_the_dump_files_it_would_remove(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """--dry-run counts the dump files in its line and lists each by path below it, and
    removes neither a row nor a file."""
    db, files = node_with_dumps(tmp_path)
    digest = file_digest(db)
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--dry-run", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    listed = sorted(str(path) for paths in files.values() for path in paths)
    assert result.stdout.splitlines() == [
        f"{db}: would remove 2 runs (14 events, 6 Flight Recorder dump file(s)) beyond the 1"
        " newest; would keep 1",
        *(f"  {path}" for path in listed),
    ]
    assert file_digest(db) == digest
    assert all(Path(path).exists() for path in listed)


def crafted_run(db: Path, run_id: str, path: str) -> None:
    """A run row (40 days old) that names this journal, and a dump row of it naming `path`,
    written by SQL as a damaged or hand-made journal holds them."""
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO runs (run_id, created_at, host, world_size, config, lifecycle_version)"
            " VALUES (?, ?, 'h', 1, ?, '0.1.0')",
            (run_id, NOW - 40 * DAY, json.dumps({"db": str(db)})),
        )
    journal_dumps(db, (run_id, path))


@pytest.mark.parametrize("run_id", ["..", "absolute"])
def test_a_run_id_not_of_the_one_form_has_its_rows_pruned_and_no_file_touched(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed], run_id: str
) -> None:
    """A run whose id is `..` or an absolute path, with a dump row naming a file that its id
    leads to (the journal's folder, or anywhere): its rows go, the file stays."""
    db = journal_in(tmp_path / "node", aged("new", 1))
    if run_id == "..":
        (victim,) = dumps_in(db.parent, ("fr_trace_rank_0",))
        db.with_name("j.db.flight-recorder").mkdir()  # as once ranks have dumped
        path = f"{db}.flight-recorder/../fr_trace_rank_0"
    else:
        (victim,) = dumps_in(tmp_path / "victim", ("fr_trace_rank_0",))
        run_id, path = str(victim.parent), str(victim)
    crafted_run(db, run_id, path)
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{db}: removed 1 run (1 event) ")
    assert run_ids_in(db) == {"new"}
    assert victim.read_bytes() == b"dump"


def test_a_relative_dump_path_is_not_resolved_against_the_working_directory(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A dump row naming a relative path, which prune's working directory would resolve to a
    folder named for the run: the files there stay."""
    db = journal_in(tmp_path / "node", aged("r1", 50), aged("new", 1))
    victims = dumps_in(tmp_path / "elsewhere" / "r1")  # prune runs in tmp_path
    journal_dumps(db, ("r1", "elsewhere/r1/fr_trace_rank_0"))
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert run_ids_in(db) == {"new"}
    assert all(path.exists() for path in victims)


def test_a_dump_another_host_journaled_is_left_alone(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A dump row naming another host: the files at that path on this host are not that
    dump, and stay."""
    db = journal_in(tmp_path / "node", aged("r1", 50), aged("new", 1))
    victims = dumps_in(db.with_name("j.db.flight-recorder") / "r1")
    journal_dumps(db, ("r1", str(victims[0])), host=f"not-{HOST}")
    result = prune(lifecycle_cli, db, "--keep-runs", "1", "--now", str(NOW))
    assert result.returncode == 0, result.stderr
    assert "Flight Recorder" not in result.stdout
    assert all(path.exists() for path in victims)


@pytest.mark.parametrize(
    "where",
    [
        {"db": "j.db"},
        {"db": "sqlite:///sub/j.db"},
        {"db": "ABS/j.db"},
        {"db": "j.db", "flight_recorder_dir": "ABS/dumps"},
    ],
)
def test_prune_looks_for_a_runs_dumps_where_its_ranks_put_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: dict[str, str]
) -> None:
    """For a journal path given relative or absolute, or as a URL, and with or without a dump
    folder of its own, the folder prune removes a run's dumps from is the one a rank of that
    run dumps into."""
    from lifecycle.core.settings.config import ServerArgs, args_to_json
    from lifecycle.runtime.group.flightrecorder import folder_for
    from lifecycle.store import to_url
    from lifecycle.store.upkeep.dumps import ThisJournal

    monkeypatch.chdir(tmp_path)
    args = ServerArgs(**{key: value.replace("ABS", str(tmp_path)) for key, value in where.items()})
    config = args_to_json(args)
    if args.flight_recorder_dir:
        config["db"] = str(tmp_path / args.db)  # the journal named absolutely, as it must be
    found = ThisJournal.at(to_url(args.db)).run_folder("20261201-120000-abcdef", config)
    assert found == folder_for(args, "20261201-120000-abcdef")
