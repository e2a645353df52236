"""replay's commands on journals of real runs: what they print, their JSON, exit statuses."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest

from replay.cli import main
from tests.conftest import file_digest
from tests.replay.conftest import Journaled, boot, copy_journal, run_ids
from tests.replay_argv import REPLAY_COMMANDS, replay_argv

pytestmark = [pytest.mark.ranks]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_runs_lists_each_run_with_its_path_and_outcome(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """One row per run: the bounded one skipped by the explicit disable, the calibrated one
    not; both ready, with a startup time."""
    status, out, _ = run(capsys, "runs", str(bounded_and_calibrated.db), "--json")
    assert status == 0
    rows = json.loads(out)
    assert [r["run_id"] for r in rows] == list(bounded_and_calibrated.run_ids)
    bounded, calibrated = rows
    assert (bounded["path"], bounded["skip_reason"], bounded["mode"]) == (
        "bounded", "disabled by LIFECYCLE_DISABLE_AUTO_RESIDENCY", "auto"
    )  # fmt: skip
    assert (calibrated["path"], calibrated["skip_reason"], calibrated["mode"]) == (
        "calibrated", None, "auto +calibrate"
    )  # fmt: skip
    for row in rows:
        assert row["outcome"] == "ready"
        assert row["startup_to_ready_s"] > 0
        assert row["world_size"] == 1
    status, text, _ = run(capsys, "runs", str(bounded_and_calibrated.db))
    assert "disabled by LIFECYCLE_DISABLE_AUTO_RESIDENCY" in text and "calibrated" in text


def test_show_gives_timeline_records_and_buffers(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """The calibrated run's timeline lists all states, three warmup records with their memory
    source, the buffer drop in drop-buffers and the re-creation in ready."""
    status, out, _ = run(
        capsys, "show", bounded_and_calibrated.run_ids[1], str(bounded_and_calibrated.db)
    )
    assert status == 0
    for state in ("gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"):
        assert f" {state} " in out
    warmups = [line for line in out.splitlines() if line.startswith("  warmup ")]
    assert len(warmups) == 3 and "[linux-vmhwm]" in out
    assert "buffers dropped" in out and "in drop-buffers" in out
    assert "buffers allocated" in out and "in ready" in out
    _, doc, _ = run(capsys, "show", "latest", str(bounded_and_calibrated.db), "--json")
    rank0 = json.loads(doc)["ranks"][0]
    assert [w["role"] for w in rank0["warmup_records"]] == ["bounded", "probe", "rewarm"]
    assert rank0["buffer_drops"][0]["state"] == "drop-buffers"


def test_show_at_rebuilds_the_state_at_a_moment(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """--at folds only the events up to that time: before the first event nothing, during the
    run the state then, after the end the final state."""
    db = str(bounded_and_calibrated.db)
    _, out, _ = run(capsys, "show", "latest", db, "--json")
    spans = json.loads(out)["ranks"][0]["spans"]
    probe = next(s for s in spans if s["state"] == "probe")
    middle = probe["at_s"] + probe["duration_s"] / 2
    _, out, _ = run(capsys, "show", "latest", db, "--at", f"{middle}", "--json")
    assert json.loads(out)["ranks"][0]["state"] == "probe"
    _, out, _ = run(capsys, "show", "latest", db, "--at", "100000", "--json")
    assert json.loads(out)["ranks"][0]["state"] == "stopped"
    _, out, _ = run(capsys, "show", "latest", db, "--at", f"{middle}")
    assert "probe" in out


def test_diagnose_a_ready_run_exits_0(
    two_ranks: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 2-rank run that reached ready: outcome ready, no culprit, every group in step."""
    status, out, _ = run(capsys, "diagnose", "latest", str(two_ranks.db), "--json")
    doc = json.loads(out)
    assert (status, doc["outcome"], doc["culprit_ranks"]) == (0, "ready", [])
    assert all(r["status"] == "ready" for r in doc["ranks"])
    for group in doc["groups"]:
        assert len(set(group["started"].values())) == 1
        assert group["started"] == group["finished"]


def test_verify_is_consistent_on_todays_runs(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """Journals written by today's code replay without divergence."""
    status, out, _ = run(capsys, "verify", "--all", str(bounded_and_calibrated.db), "--json")
    assert status == 0
    assert [r["consistent"] for r in json.loads(out)] == [True, True]


def test_verify_catches_a_path_todays_gates_would_not_take(
    bounded_and_calibrated: Journaled, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A calibrated run whose recorded config no longer opts in (a model without residency
    options, no --calibrate): today's gates skip with the planner reason, and verify says the
    recorded path probed."""
    db = tmp_path / "edited.db"
    copy_journal(bounded_and_calibrated.db, db)
    run_id = bounded_and_calibrated.run_ids[1]
    with sqlite3.connect(db) as conn:
        (config,) = conn.execute("SELECT config FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        edited = json.loads(config)
        edited["calibrate"] = False
        edited["model"]["declares_residency"] = False
        conn.execute("UPDATE runs SET config = ? WHERE run_id = ?", (json.dumps(edited), run_id))
    status, out, _ = run(capsys, "verify", run_id, str(db))
    assert status == 1
    assert "recorded path probed" in out
    assert "today's gates skip: residency planner not available" in out
    assert "today's table refuses it" in out


def test_trace_is_valid_chrome_trace_json(
    two_ranks: Journaled, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The trace has one process per rank, every span closed with a duration, collectives on
    their own thread, flow arrows that start and finish, and memory counters."""
    out_file = tmp_path / "trace.json"
    status, _, _ = run(capsys, "trace", "latest", str(two_ranks.db), "-o", str(out_file))
    assert status == 0
    trace = json.loads(out_file.read_text())
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    spans = [e for e in events if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert all(isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in spans)
    assert not [e for e in events if e["ph"] in ("B", "E")]
    assert {e["tid"] for e in spans if e["cat"] == "collective"} == {3}
    assert {e["name"] for e in spans if e["cat"] == "state" and e["pid"] == 0} >= {
        "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"
    }  # fmt: skip
    flows: dict[int, list[str]] = {}
    for e in events:
        if e["ph"] in ("s", "t", "f"):
            flows.setdefault(e["id"], []).append(e["ph"])
    assert flows and all(phases[0] == "s" and phases[-1] == "f" for phases in flows.values())
    assert any(e["ph"] == "C" and e["name"] == "memory" for e in events)
    assert any(e["ph"] == "i" and e["name"] == "heartbeat" for e in events)


def test_trace_refuses_to_overwrite_a_journal(
    two_ranks: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """-o naming a journal being read is refused; the journal is unchanged."""
    before = file_digest(two_ranks.db)
    status, _, err = run(capsys, "trace", "latest", str(two_ranks.db), "-o", str(two_ranks.db))
    assert status == 2 and "one of the journals" in err
    assert file_digest(two_ranks.db) == before


def test_diff_of_bounded_and_calibrated_runs(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """Side by side with the verdict: B (bounded) skips the probe, 3 requests at 4 steps down
    to 1 at 2, and each side's warmup time is its requests' (how long they took is the
    machine's, not a fact a test can hold)."""
    bounded, calibrated = bounded_and_calibrated.run_ids
    status, out, _ = run(capsys, "diff", calibrated, bounded, str(bounded_and_calibrated.db))
    assert status == 0
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith(
        "B skips the probe: 3 warmup requests at 4 steps -> 1 warmup request at 2 steps; warmup"
    )
    assert "in probe" in out and "peak in probe" in out
    _, out, _ = run(capsys, "diff", calibrated, bounded, str(bounded_and_calibrated.db), "--json")
    doc = json.loads(out)
    assert doc["a"]["calibrated"] and not doc["b"]["calibrated"]
    assert [(w["role"], w["steps"]) for w in doc["b"]["warmup"]] == [("bounded", 2)]
    assert [w["steps"] for w in doc["a"]["warmup"]] == [4, 4, 4]
    for side in ("a", "b"):
        lines = doc[side]["warmup"]
        assert doc[side]["warmup_s"] == pytest.approx(sum(w["total_s"] for w in lines))
        assert all(w["total_s"] > 0 for w in lines)


# Slow tier: `replay diff` of two runs is the default run's (the tests above).
@pytest.mark.slow
def test_diff_of_runs_of_different_models_or_layouts_says_so_first(
    bounded_and_calibrated: Journaled,
    two_ranks: Journaled,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Runs of two models, or of one model on two layouts, are said to be apart before any
    time is compared, and the table shows each side's model and layout."""
    db = tmp_path / "j.db"
    boot(db, "--model", "tiny-video", "--warmup-mode", "none")
    copy_journal(bounded_and_calibrated.db, tmp_path / "micro.db")
    (tiny,) = run_ids(db)
    micro = bounded_and_calibrated.run_ids[0]
    status, out, _ = run(capsys, "diff", micro, tiny, str(tmp_path / "micro.db"), str(db))
    assert status == 0
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith(
            "different models: A is micro-video, B is tiny-video (their times are not comparable);"
        )
    )
    assert re.search(r"model +micro-video +tiny-video", out)
    _, out, _ = run(
        capsys, "diff", micro, two_ranks.run_ids[0], str(bounded_and_calibrated.db),
        str(two_ranks.db), "--json",
    )  # fmt: skip
    doc = json.loads(out)
    assert doc["verdict"].startswith(
        "different layouts: A on 1 rank (cfg 1 x ulysses 1), B on 2 ranks (cfg 1 x ulysses 2)"
    )
    assert doc["a"]["model_digest"] == doc["b"]["model_digest"]
    _, out, _ = run(capsys, "diff", *bounded_and_calibrated.run_ids, str(bounded_and_calibrated.db))
    assert "not comparable" not in out


def test_one_file_per_rank_merges_like_one_file(
    two_ranks: Journaled, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Splitting a 2-rank journal into one file per rank gives the same diagnosis; leaving one
    file out names the absent rank and still diagnoses the other."""
    files = []
    for keep in (0, 1):
        copy = tmp_path / f"rank{keep}.db"
        copy_journal(two_ranks.db, copy)
        with sqlite3.connect(copy) as conn:
            conn.execute("DELETE FROM events WHERE rank != ?", (keep,))
        files.append(str(copy))
    _, whole, _ = run(capsys, "diagnose", "latest", str(two_ranks.db), "--json")
    _, split, _ = run(capsys, "diagnose", "latest", *files, "--json")
    assert json.loads(split)["outcome"] == json.loads(whole)["outcome"] == "ready"
    assert json.loads(split)["ranks"] == json.loads(whole)["ranks"]
    status, out, _ = run(capsys, "diagnose", "latest", files[0], "--json")
    doc = json.loads(out)
    assert status == 3  # no failure found, not ready
    assert doc["missing_ranks"] == [1]
    assert doc["outcome"] == "incomplete"
    assert [r["rank"] for r in doc["ranks"]] == [0]
    assert "no journal for rank 1" in doc["summary"]


def test_journals_of_different_runs_are_told_apart(
    bounded_and_calibrated: Journaled, two_ranks: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """Given journals of different runs, runs lists them all and each is diagnosed alone."""
    status, out, _ = run(
        capsys, "runs", str(bounded_and_calibrated.db), str(two_ranks.db), "--json"
    )
    assert status == 0
    ids = [r["run_id"] for r in json.loads(out)]
    assert sorted(ids) == sorted(bounded_and_calibrated.run_ids + two_ranks.run_ids)
    status, out, _ = run(
        capsys, "diagnose", two_ranks.run_ids[0], str(bounded_and_calibrated.db),
        str(two_ranks.db), "--json",
    )  # fmt: skip
    assert json.loads(out)["run_id"] == two_ranks.run_ids[0]


def test_a_journal_cut_off_mid_run_is_diagnosed_from_what_is_left(
    two_ranks: Journaled, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1's events cut off in bounded-warm (as a SIGKILL leaves them) while rank 0 goes on
    heartbeating: rank 1 crashed in bounded-warm."""
    cut = tmp_path / "cut.db"
    copy_journal(two_ranks.db, cut)
    with sqlite3.connect(cut) as conn:
        (first_probe,) = conn.execute(
            "SELECT min(seq) FROM events WHERE rank = 1 AND state = 'bounded-warm'"
        ).fetchone()
        conn.execute("DELETE FROM events WHERE rank = 1 AND seq > ?", (first_probe + 3,))
    status, out, _ = run(capsys, "diagnose", "latest", str(cut), "--json")
    doc = json.loads(out)
    assert status == 1
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "crashed", [1], "bounded-warm"
    )  # fmt: skip


@pytest.mark.parametrize("command", REPLAY_COMMANDS)
def test_no_command_writes_to_the_journals_it_reads(
    two_ranks: Journaled, tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """After each command the journal files' bytes are what they were."""
    db = tmp_path / "copy.db"
    copy_journal(two_ranks.db, db)
    before = file_digest(db)
    run(capsys, *replay_argv(command, db, trace=tmp_path / "t.json"))
    assert file_digest(db) == before


def test_run_references(
    bounded_and_calibrated: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """A unique prefix resolves; a prefix of two runs and an unknown id are one-line errors
    with exit status 2."""
    db = str(bounded_and_calibrated.db)
    first, second = bounded_and_calibrated.run_ids
    status, out, _ = run(capsys, "diagnose", first, db, "--json")
    assert json.loads(out)["run_id"] == first
    common = first[: next(i for i in range(len(first)) if first[i] != second[i])]
    status, _, err = run(capsys, "diagnose", common, db)
    assert status == 2 and "matches 2 runs" in err and len(err.strip().splitlines()) == 1
    status, _, err = run(capsys, "diagnose", "no-such-run", db)
    assert status == 2 and "no run matches 'no-such-run'" in err


def test_show_ends_each_rank_with_its_last_collectives(
    two_ranks: Journaled, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default each rank's last ten collective records before its end; `--last N` any
    number; `--all` every event of each rank in order; the JSON has the same records."""
    db = str(two_ranks.db)
    with sqlite3.connect(db) as conn:
        top = dict(
            conn.execute(
                "SELECT rank, max(seq) FROM events WHERE kind LIKE 'collective_%' GROUP BY rank"
            ).fetchall()
        )
        total = dict(conn.execute("SELECT rank, count(*) FROM events GROUP BY rank").fetchall())
    status, out, _ = run(capsys, "show", "latest", db)
    assert status == 0
    assert out.count("last 10 collective records before the end") == 2
    listed = [line.split() for line in out.splitlines() if "collective_" in line]
    assert len(listed) == 20
    assert {int(fields[1]) for fields in listed} >= set(top.values())
    _, out, _ = run(capsys, "show", "latest", db, "--last", "3", "--rank", "1")
    assert [line.split()[1] for line in out.splitlines() if "collective_" in line][-1] == str(
        top[1]
    )
    assert sum("collective_" in line for line in out.splitlines()) == 3
    _, out, _ = run(capsys, "show", "latest", db, "--all", "--rank", "0")
    events = [line.split() for line in out.splitlines() if line.strip().startswith("+")]
    seqs = [int(f[1]) for f in events if len(f) > 1 and f[1].isdigit()]
    assert seqs == list(range(total[0]))
    _, doc, _ = run(capsys, "show", "latest", db, "--json", "--last", "4")
    for rank in json.loads(doc)["ranks"]:
        assert [c["seq"] for c in rank["last_collectives"]][-1] == top[rank["rank"]]
        assert len(rank["last_collectives"]) == 4
    with pytest.raises(SystemExit) as stopped:
        main(["show", "latest", db, "--last", "-1"])
    assert stopped.value.code == 2
    assert "'-1' is not a number of records" in capsys.readouterr().err
