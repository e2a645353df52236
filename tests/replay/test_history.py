"""`replay history` over journals written through the real writer, and the liveness replay reads
from a serving rank's heartbeat kept in place in its summary row."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

from alembic import command

from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    Event,
    Expectations,
    LoadFinished,
    LoadStarted,
    RunStarted,
    Transition,
)
from lifecycle.store import Journal, RunRow, to_url
from lifecycle.store.backends.revisions import alembic_config
from tests.conftest import Completed, run_cli
from tests.replay.conftest import boot, run_ids
from tests.replay.fastpath import verdicts_agree
from tests.support import T0

BOUNDED = "00000000000000aa/bounded"
CALIBRATED = "00000000000000aa/calibrated"
CONFIG = {"model": {"name": "micro-video"}, "num_ranks": 1, "cfg_parallel": 1, "ulysses": 1}
LAUNCH_S = 2.0  # from a run's creation to its rank's first event


def healthy_run(
    journal: Journal,
    run_id: str,
    at: float,
    spent: dict[str, float],
    *,
    key: str = BOUNDED,
    loads: dict[str, float] | None = None,
) -> float:
    """A one-rank run created at `at` whose rank spends `spent` seconds in each state (created
    first), loads each of `loads`'s components in the seconds it gives at gate-check, and
    finishes its ready action; when it entered ready."""
    journal.create_run(RunRow(run_id=run_id, created_at=at, host="elsewhere", world_size=1,
                              config=CONFIG, lifecycle_version="t"))  # fmt: skip
    writer = journal.writer(run_id=run_id, rank=0)
    wall = at + LAUNCH_S
    started = RunStarted(world_size=1, host="elsewhere", pid=1, lifecycle_version="t",
                         torch_version="t", python_version="t", device="cpu",
                         dist_backend=None, process_started_wall=at + 0.5)  # fmt: skip
    items: list[tuple[Event, str, float]] = [(started, "created", wall)]
    states = [*spent, "ready"]
    for source, dest in itertools.pairwise(states):
        wall += spent[source]
        items.append((Transition(trigger="t", source=source, dest=dest), dest, wall))
        if dest == "gate-check":
            items.append((Expectations(key=key, runs=0, states=()), dest, wall))
            for component, seconds in (loads or {}).items():
                items.append((LoadStarted(component=component, files=(), bytes=1), dest, wall))
                finished = LoadFinished(
                    component=component, seconds=seconds, read_s=seconds, device_s=0.0,
                    bytes=1, dtype="float32", ok=True,
                )  # fmt: skip
                items.append((finished, dest, wall))
    items.append((ActionStarted(action="mark-ready"), "ready", wall))
    items.append((ActionFinished(action="mark-ready", duration_s=0.0, ok=True), "ready", wall))
    for event, state, when in items:
        writer.append(event, state=state, wall_time=when, mono_ns=0)
    writer.close()
    return wall


def spent(bounded_warm: float) -> dict[str, float]:
    return {"created": 0.5, "gate-check": 1.0, "bounded-warm": bounded_warm}


def history(db: Path, *args: str) -> Completed:
    return run_cli("replay", ["history", str(db), *args], cwd=db.parent, timeout=60)


def keyed(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {h["key"]: h for h in doc["histories"]}


def test_history_gives_each_state_per_fingerprint_and_path(tmp_path: Path) -> None:
    """Each key's states with their median, p95 and count, and its startup to ready from
    the launch and from the process start, over every healthy run."""
    db = tmp_path / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        for index, seconds in enumerate((2.0, 4.0, 3.0)):
            healthy_run(journal, f"bounded-{index}", T0 + 100 * index, spent(seconds))
        healthy_run(journal, "calibrated-0", T0 + 500, spent(9.0), key=CALIBRATED)
    done = history(db, "--json")
    assert done.returncode == 0, done.stderr
    found = keyed(json.loads(done.stdout))
    assert sorted(found) == [BOUNDED, CALIBRATED]
    bounded = found[BOUNDED]
    assert (bounded["model"], bounded["path"], bounded["runs"]) == ("micro-video", "bounded", 3)
    states = {s["state"]: s for s in bounded["states"]}
    assert list(states) == ["created", "gate-check", "bounded-warm"]
    assert states["bounded-warm"] == {"state": "bounded-warm", "median_s": 3.0, "p95_s": 4.0,
                                      "count": 3}  # fmt: skip
    # Launch to ready: LAUNCH_S, then created, gate-check and bounded-warm.
    assert bounded["startup_to_ready"]["median_s"] == LAUNCH_S + 0.5 + 1.0 + 3.0
    assert bounded["startup_from_process_start"]["median_s"] == LAUNCH_S - 0.5 + 0.5 + 1.0 + 3.0
    assert found[CALIBRATED]["runs"] == 1


def test_history_names_the_run_that_regressed(tmp_path: Path) -> None:
    """A run whose state took over 1.5x the median of the runs before it is named, with the
    state, its time and that median; the runs before it are not."""
    db = tmp_path / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        for index in range(5):
            healthy_run(journal, f"run-{index}", T0 + 100 * index, spent(2.0))
        healthy_run(journal, "run-slow", T0 + 600, spent(7.0))
    found = keyed(json.loads(history(db, "--json").stdout))[BOUNDED]
    regressed = {(r["run_id"], r["what"]) for r in found["regressions"]}
    assert regressed == {("run-slow", "bounded-warm"), ("run-slow", "startup to ready"),
                         ("run-slow", "startup from process start")}  # fmt: skip
    (state,) = [r for r in found["regressions"] if r["what"] == "bounded-warm"]
    assert (state["seconds"], state["median_s"], state["runs_before"]) == (7.0, 2.0, 5)
    text = history(db).stdout
    assert "run run-slow: bounded-warm 7.00 s, 3.5x the median 2.00 s of 5 run(s) before it" in text


def test_history_prints_a_table_per_fingerprint_and_path(tmp_path: Path) -> None:
    """Without --json: a heading naming the model, layout, path and fingerprint, then a row
    per state and per startup figure."""
    db = tmp_path / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        healthy_run(journal, "run-0", T0, spent(2.0))
    lines = history(db).stdout.splitlines()
    assert lines[0].startswith("micro-video  ranks=1 cfg=1 ulysses=1  path bounded")
    assert "fingerprint 00000000000000aa  1 run(s)" in lines[0]
    rows = {line.split()[0] for line in lines[3:] if line.strip()}
    assert {"created", "gate-check", "bounded-warm", "startup"} <= rows
    assert lines[-1] == "  no run regressed"


def test_history_of_a_journal_before_the_history_says_how_to_keep_it(tmp_path: Path) -> None:
    """A journal at revision 0003 has no history: one warning naming `lifecycle db upgrade`,
    and exit 0."""
    db = tmp_path / "old.db"
    command.upgrade(alembic_config(to_url(str(db))), "0003")
    done = history(db)
    assert done.returncode == 0
    assert done.stdout.strip() == "no healthy startups in the history"
    assert "at revision 0003, before the startup history" in done.stderr
    assert "lifecycle db upgrade" in done.stderr


def test_a_serving_rank_is_alive_while_its_summary_row_beats(tmp_path: Path) -> None:
    """A serving rank whose heartbeats are kept in its summary row, and not journaled, is
    ready to `replay diagnose` a second after its last beat, and crashed ten seconds after
    it."""
    db = tmp_path / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        ready_at = healthy_run(journal, "serving", T0, spent(2.0))
        writer = journal.writer(run_id="serving", rank=0, resume=True)
        beat = ready_at + 600.0
        writer.beat(beat)
        writer.close()

    def outcome(now: float) -> str:
        done = run_cli("replay", ["diagnose", "serving", str(db), "--json", "--now", str(now)],
                       cwd=tmp_path, timeout=60)  # fmt: skip
        return str(json.loads(done.stdout)["outcome"])

    assert outcome(beat + 1.0) == "ready"
    assert outcome(beat + 10.0) == "crashed"


def test_history_help_says_what_it_reads_and_its_exit_statuses() -> None:
    """`replay history --help` says what JOURNAL is, where the history comes from, and the
    statuses it exits with (0 and 2)."""
    done = run_cli("replay", ["history", "--help"], cwd=Path.cwd(), timeout=60)
    assert done.returncode == 0
    assert "JOURNAL  a SQLite file path or a SQLAlchemy URL" in done.stdout
    assert "revision 0004" in done.stdout
    listed = done.stdout.split("exit status:\n", 1)[1]
    assert [line.split()[0] for line in listed.splitlines() if line[:3].strip()] == ["0", "2"]


def test_history_follows_each_components_load_and_names_a_load_that_regressed(
    tmp_path: Path,
) -> None:
    """Each component's load per fingerprint (median, p95, runs), apart from the states, and
    a run whose transformer took over 1.5x the median of the runs before it is named, while
    no state's learned deadline counts a load."""
    db = tmp_path / "j.db"
    with Journal.open_for_write(str(db)) as journal:
        for index in range(6):
            seconds = 9.0 if index == 5 else 2.0 + 0.1 * index
            healthy_run(
                journal, f"run-{index}", T0 + 100 * index, spent(3.0),
                loads={"text_encoder": 1.0, "transformer": seconds},
            )  # fmt: skip
    done = history(db, "--json")
    assert done.returncode == 0, done.stderr
    bounded = keyed(json.loads(done.stdout))[BOUNDED]
    assert [s["state"] for s in bounded["states"]] == ["created", "gate-check", "bounded-warm"]
    loads = {load["component"]: load for load in bounded["loads"]}
    assert list(loads) == ["text_encoder", "transformer"]
    assert loads["text_encoder"]["median_s"] == 1.0 and loads["transformer"]["count"] == 6
    (regressed,) = bounded["regressions"]
    assert (regressed["run_id"], regressed["what"]) == ("run-5", "load transformer")
    text = history(db).stdout
    assert "load transformer" in text and "run run-5: load transformer 9.00 s" in text


def test_runs_and_history_name_the_path_of_a_run_that_reused_a_plan_alike(
    tmp_path: Path,
) -> None:
    """Three real boots of micro-video, the later two reusing the residency plan the first
    verified: `replay runs` names each run's path with the word `replay history` heads its key
    with (calibrated, then reused), in its table and its JSON, and says the same of each run
    from its ranks' summaries as from their events; `replay diff` of the two that reused says
    they took the same path, the reused one."""
    db = tmp_path / "j.db"
    for _ in range(3):
        boot(db)
    first, second, third = run_ids(db)
    listed = run_cli("replay", ["runs", str(db), "--json"], cwd=tmp_path, timeout=60)
    assert listed.returncode == 0, listed.stderr
    by_runs = {run["run_id"]: run["path"] for run in json.loads(listed.stdout)}
    said = json.loads(history(db, "--json").stdout)["histories"]
    by_history = {run: h["path"] for h in said for run in (h["first_run"], h["last_run"])}
    assert by_runs == by_history == {first: "calibrated", second: "reused", third: "reused"}
    table = run_cli("replay", ["runs", str(db)], cwd=tmp_path, timeout=60).stdout.splitlines()
    header = table[0].split()
    row = next(line.split() for line in table if line.startswith(second))
    assert row[header.index("path") + 1] == "reused"  # the `started` column is two words
    assert verdicts_agree(db) == 3
    diffed = run_cli("replay", ["diff", second, third, str(db)], cwd=tmp_path, timeout=60)
    assert "same path (reused);" in diffed.stdout, diffed.stdout + diffed.stderr
