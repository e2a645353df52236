"""Adding a state is one table row and one actions entry: shown with a test-only state."""

from __future__ import annotations

import time
from enum import StrEnum
from pathlib import Path

from lifecycle.core.format.events import ActionStarted, Transition
from lifecycle.core.format.fold import fold_run
from lifecycle.core.format.states import TRANSITIONS, Edge, State, Trigger, action_states, mermaid
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.actions import STARTUP_ACTIONS
from lifecycle.runtime.rankruntime import RankRuntime
from lifecycle.runtime.recorder import Recorder
from lifecycle.runtime.session import RankLaunch, RankSession
from lifecycle.store.journal import Journal
from lifecycle.store.runs import new_run_id, open_run


class Added(StrEnum):
    COMPILE = "compile"


class AddedTrigger(StrEnum):
    COMPILE = "compile"


def with_compile_state() -> tuple[Edge, ...]:
    """The table with a `compile` state between gate-check and bounded-warm: the one row that
    led from gate-check now leads to compile, and compile leads on (and may fail)."""
    table: list[Edge] = []
    for edge in TRANSITIONS:
        if edge.trigger is Trigger.WARM:
            table.append(Edge(trigger=AddedTrigger.COMPILE, source=edge.source, dest=Added.COMPILE))  # type: ignore[arg-type]
            table.append(Edge(trigger=Trigger.WARM, source=Added.COMPILE, dest=edge.dest))  # type: ignore[arg-type]
            table.append(Edge(trigger=Trigger.FAIL, source=Added.COMPILE, dest=State.FAILED))  # type: ignore[arg-type]
        else:
            table.append(edge)
    return tuple(table)


def test_a_new_state_needs_one_table_row_and_one_actions_entry(tmp_path: Path) -> None:
    """A real one-rank startup walks the extended table through `compile`, runs its action
    there, write-ahead, and reaches ready; nothing else in lifecycle had to change."""
    compiled: list[str] = []

    def compile_graphs(rt: RankRuntime) -> None:
        assert rt.pipeline is not None
        compiled.append(rt.args.model.name)

    table = with_compile_state()
    actions = {**STARTUP_ACTIONS, Added.COMPILE: (("compile-graphs", compile_graphs),)}
    assert set(actions) == set(action_states(table))
    args = ServerArgs(
        model=MODEL_PRESETS["micro-video"], db=str(tmp_path / "j.db"), disable_auto_residency=True
    )
    run_id = new_run_id(time.time())
    journal = open_run(args, run_id=run_id, created_at=time.time())
    session = RankSession(
        args,
        RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False),
        Recorder(journal.writer(run_id=run_id, rank=0)),
        actions=actions,  # type: ignore[arg-type]
        table=table,
    )
    assert session.boot() == State.READY
    session.close()
    journal.close()
    assert compiled == ["micro-video"]
    reader = Journal.open_for_read(str(tmp_path / "j.db"))
    events = list(reader.read(run_id=run_id))
    reader.close()
    path = [e.event.dest for e in events if isinstance(e.event, Transition)]
    assert path == ["gate-check", "compile", "bounded-warm", "ready"]
    announced = next(
        e
        for e in events
        if isinstance(e.event, ActionStarted) and e.event.action == "compile-graphs"
    )
    assert announced.state == "compile"
    assert fold_run(events)[0].path == ("created", "gate-check", "compile", "bounded-warm", "ready")
    assert "compile" not in mermaid()  # the product's own table is untouched
