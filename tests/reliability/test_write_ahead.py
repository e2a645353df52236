"""Write-ahead: every action and every collective is on disk before it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lifecycle.core.format.events import ActionStarted
from lifecycle.core.format.states import State
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.actions import STARTUP_ACTIONS, Action
from lifecycle.runtime.rankruntime import RankRuntime
from lifecycle.runtime.recorder import Recorder
from lifecycle.runtime.session import RankLaunch, RankSession
from lifecycle.serve.ranks.supervisor import free_port
from lifecycle.store.journal import Journal
from lifecycle.store.runs import new_run_id, run_row


def test_every_action_is_announced_on_disk_before_it_runs(tmp_path: Path) -> None:
    """At the first line of every action of a calibrated startup (smoke request included), a
    separate read-only connection already finds that action's action_started, in its state."""
    db = str(tmp_path / "j.db")
    seen: list[tuple[str, str, str, str]] = []

    def checked(state: State, name: str, action: Action) -> Action:
        def run(rt: RankRuntime) -> None:
            reader = Journal.open_for_read(db)
            # The heartbeat thread may append between the announcement and this line.
            last = [e for e in reader.read() if e.kind != "heartbeat"][-1]
            reader.close()
            assert isinstance(last.event, ActionStarted)
            seen.append((name, last.event.action, last.state, state.value))
            action(rt)

        return run

    actions = {
        state: tuple((name, checked(state, name, fn)) for name, fn in named)
        for state, named in STARTUP_ACTIONS.items()
    }
    args = ServerArgs(model=MODEL_PRESETS["micro-video"], db=db, calibrate=True)
    journal = Journal.open_for_write(db)
    run_id = new_run_id(time.time())
    journal.create_run(run_row(args, run_id=run_id, created_at=time.time()))
    session = RankSession(
        args,
        RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False),
        Recorder(journal.writer(run_id=run_id, rank=0)),
        actions=actions,
    )
    assert session.boot() is State.READY
    session.close()
    assert [name for name, *_ in seen] == [
        "load-pipeline", "check-ranks", "decide-path", "apply-reused-residency", "bounded-warmup",
        "verify-weights", "warm-learned-shapes", "probe",
        "plan-residency", "apply-residency", "re-warmup", "verify-residency", "drop-buffers",
        "mark-ready",
    ]  # fmt: skip
    for name, announced, journaled_state, state in seen:
        assert (announced, journaled_state) == (name, state)


@pytest.mark.ranks
def test_every_collective_is_announced_on_disk_before_it_starts(tmp_path: Path) -> None:
    """In two real rank processes, each call into torch.distributed finds its
    collective_started already committed (read through a separate connection)."""
    db = tmp_path / "j.db"
    Journal.open_for_write(str(db)).close()
    env = {
        **os.environ, "PYTHONWARNINGS": "ignore", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
        "LIFECYCLE_RUN_ID": new_run_id(time.time()),
    }  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.reliability.write_ahead_rank",
                str(db),
                str(tmp_path / f"rank{r}.json"),
            ],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=Path(__file__).parents[2],
        )
        for r in range(2)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    assert codes == [0, 0]
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        checks = report["checks"]
        assert len(checks) > 50
        assert {c["call"] for c in checks} == {"all_to_all_single", "all_gather", "all_reduce"}
        assert [c for c in checks if not c["announced"]] == []
