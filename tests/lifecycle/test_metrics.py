"""/metrics and /liveness of a real `lifecycle serve`: real ranks, a real HTTP server on
127.0.0.1, the text parsed with prometheus_client's own parser."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from lifecycle import __version__
from tests.support import BODY, scrape, serve, value

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]


OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def readme_metrics() -> dict[str, set[str]]:
    """docs/operations.md's /metrics table: each metric it names (`process_*` stands for that
    family), with the labels it lists (an explanation in parentheses is not a label)."""
    after = OPERATIONS.read_text(encoding="utf-8").split("`GET /metrics` is Prometheus's", 1)[1]
    lines = after.split("| metric | labels | from |", 1)[1].splitlines()[2:]
    table: dict[str, set[str]] = {}
    for line in lines:
        if not line.startswith("|"):
            break
        names, labels = line.split("|")[1:3]
        listed = {w.strip() for w in re.sub(r"\(.*?\)", "", labels).split(",") if w.strip()}
        for name in re.findall(r"`([a-z_*]+)`", names):
            table[name] = listed
    return table


def served_name(family: str, samples: list[Sample], table: dict[str, set[str]]) -> str | None:
    """The docs' name for a served family: as exposed (with _total or _info), or the
    family's own (a histogram's), or the `process_*` row."""
    exposed = {s.name for s in samples} | {family, f"{family}_total", f"{family}_info"}
    named = exposed & table.keys()
    if named:
        return named.pop()
    return "process_*" if family.startswith("process_") else None


def test_a_scrape_holds_what_the_readme_lists_and_what_operators_expect(tmp_path: Path) -> None:
    """Every metric the docs' table lists is served with the labels it lists, and every
    lifecycle_ metric served is listed; a /generate is in the duration histogram, the line
    is empty after it, the build and each rank's last heartbeat are there, and the server's
    own process_* metrics. With --access-log each request is a log line (JSON here)."""
    table = readme_metrics()
    expected = {"lifecycle_build_info", "lifecycle_request_duration_seconds", "process_*",
                "lifecycle_queue_depth", "lifecycle_heartbeat_timestamp_seconds"}  # fmt: skip
    assert expected <= table.keys()
    logs = ("--access-log", "--json-logs", "--log-level", "info")
    with serve(tmp_path, *logs) as served:
        served.wait_for_health(200, within=120)
        headers = {"X-Request-ID": "scraped-1"}
        assert served.client.post("/generate", json=BODY, headers=headers).status_code == 200
        families = {
            f.name: f.samples for f in text_string_to_metric_families(
                served.client.get("/metrics").text
            )
        }  # fmt: skip
        (rank,) = served.client.get("/lifecycle").json()["ranks"]
        now = time.time()
        assert served.stop() == 0
    listed: dict[str | None, str] = {}
    unlisted = []
    for name, samples in families.items():
        readme_name = served_name(name, samples, table)
        listed[readme_name] = name
        if readme_name is None and name.startswith("lifecycle_"):
            unlisted.append(name)
    assert unlisted == []
    assert table.keys() <= listed.keys(), table.keys() - listed.keys()
    for name, family in listed.items():
        if name is None or name == "process_*" or not families[family]:
            continue
        labels = {key for sample in families[family] for key in sample.labels} - {"le"}
        assert labels == table[name], name
    # The startup accounted, in /lifecycle and as a phase per series (unattributed with them).
    startup = rank["startup"]
    assert startup["ready"] and {"text_encoder", "dit", "vae"} <= {
        load["component"] for load in startup["loads"]
    }
    phases = {s.labels["phase"]: s.value for s in families["lifecycle_startup_phase_seconds"]}
    assert phases["import torch"] > 0 and "gate-check/load-pipeline" in phases
    assert phases["unattributed"] == pytest.approx(startup["unattributed_s"], abs=1e-6)
    duration = families["lifecycle_request_duration_seconds"]
    assert value(duration, "lifecycle_request_duration_seconds_count", outcome="ok") == 1
    assert value(families["lifecycle_queue_depth"], "lifecycle_queue_depth") == 0
    build = families["lifecycle_build_info"]
    assert [s.labels["version"] for s in build] == [__version__]
    beat = value(
        families["lifecycle_heartbeat_timestamp_seconds"],
        "lifecycle_heartbeat_timestamp_seconds",
        rank="0",
    )
    assert now - 60 < beat <= now
    memory = families["process_resident_memory_bytes"]
    assert value(memory, "process_resident_memory_bytes") > 2**20
    # --access-log: one JSON line per HTTP request, as every line is with --json-logs.
    said = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines()]
    requests = [line for line in said if line["event"] == "http_request"]
    generated = [line for line in requests if line["path"] == "/generate"]
    assert [(g["method"], g["status"], g["request_id"]) for g in generated] == [
        ("POST", 200, "scraped-1")
    ]  # fmt: skip
    assert generated[0]["duration_s"] > 0 and generated[0]["client"].startswith("127.0.0.1:")
    assert any(r["path"] == "/metrics" and r["status"] == 200 for r in requests)


@pytest.mark.slow
def test_a_calibrated_two_rank_serve_is_scraped_across_its_processes(tmp_path: Path) -> None:
    """Each rank's state, time per state, startup to ready, warmup by role and the probe's
    shape come from the journal; each rank's journal appends from its own process (the
    multiprocess collector); requests are counted as they finish."""
    with serve(tmp_path, "--num-ranks", "2") as served:
        served.wait_for_health(200, within=120)
        metrics = scrape(served)
        for rank in ("0", "1"):
            state = metrics["lifecycle_rank_state"]
            assert value(state, "lifecycle_rank_state", rank=rank, state="ready") == 1
            assert value(state, "lifecycle_rank_state", rank=rank, state="failed") == 0
            spent = {
                s.labels["state"]
                for s in metrics["lifecycle_state_seconds"]
                if s.labels["rank"] == rank
            }
            assert spent == {
                "created", "gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready"
            }  # fmt: skip
            ready = metrics["lifecycle_startup_to_ready_seconds"]
            assert value(ready, "lifecycle_startup_to_ready_seconds", rank=rank) > 0
            roles = {
                s.labels["role"]
                for s in metrics["lifecycle_warmup_request_seconds"]
                if s.labels["rank"] == rank
            }
            assert roles == {"bounded", "probe", "rewarm"}
            peak = metrics["lifecycle_warmup_peak_bytes"]
            assert value(peak, "lifecycle_warmup_peak_bytes", rank=rank, role="probe") > 2**20
            shape = metrics["lifecycle_probe_shape_info"]
            probe = [s.labels for s in shape if s.labels["rank"] == rank]
            assert [(p["width"], p["height"], p["frames"]) for p in probe] == [("512", "288", "33")]
            appends = metrics["lifecycle_journal_append_seconds"]
            assert value(appends, "lifecycle_journal_append_seconds_count", rank=rank) > 20
            errors = metrics["lifecycle_journal_write_errors"]
            assert value(errors, "lifecycle_journal_write_errors_total", rank=rank) == 0
            plan = metrics["lifecycle_residency_plan_info"]
            assert [s.labels["status"] for s in plan if s.labels["rank"] == rank] == ["verified"]
            assert (
                value(metrics["lifecycle_rank_healthy"], "lifecycle_rank_healthy", rank=rank) == 1
            )
        smoke = value(
            metrics["lifecycle_requests"], "lifecycle_requests_total", rank="0", outcome="ok"
        )
        assert served.client.post("/generate", json=BODY).status_code == 200
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the server folds the journal every 0.2 s
            after = scrape(served)["lifecycle_requests"]
            ok = [value(after, "lifecycle_requests_total", rank=r, outcome="ok") for r in "01"]
            if ok == [smoke + 1, smoke + 1]:
                break
            time.sleep(0.2)
        assert ok == [smoke + 1, smoke + 1]
        assert value(after, "lifecycle_requests_total", rank="1", outcome="failed") == 0
        assert served.stop() == 0


def test_a_fatal_startup_failure_turns_liveness_503_and_serve_exits_after_linger(
    tmp_path: Path,
) -> None:
    """`--fault 1:probe:raise`: /liveness answers 503 once the failure is seen, /metrics says
    which rank failed, and after --linger the server stops and exits 1 (a pod restarts)."""
    with serve(
        tmp_path, "--num-ranks", "2", "--fault", "1:probe:raise", "--dist-timeout", "3",
        "--linger", "3",
    ) as served:  # fmt: skip
        seen: list[int] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            response = served.get("/liveness")
            if response is not None:
                seen.append(response.status_code)
                if response.status_code == 503:
                    break
            time.sleep(0.1)
        assert seen and seen[-1] == 503, seen[-5:]
        assert set(seen) <= {200, 503}
        state = scrape(served)["lifecycle_rank_state"]
        assert value(state, "lifecycle_rank_state", rank="1", state="failed") == 1
        assert served.proc.wait(timeout=60) == 1
        served.client.close()
    log = (tmp_path / "serve.log").read_text()
    assert "stopped after --linger 3 s" in log
