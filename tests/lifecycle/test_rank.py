"""One rank's session in process: write-ahead order, the plug-in point, failure handling."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from lifecycle.core.errors import IllegalTransition
from lifecycle.core.format.events import ActionStarted, Error, Transition
from lifecycle.core.format.fold import fold_run
from lifecycle.core.format.states import ACTION_STATES, State, Trigger
from lifecycle.core.settings.config import ServerArgs
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.runtime.actions import STARTUP_ACTIONS
from lifecycle.runtime.pipeline import register_pipeline
from lifecycle.runtime.recorder import Recorder
from lifecycle.runtime.session import RankLaunch, RankSession
from lifecycle.store.journal import Journal
from lifecycle.store.runs import new_run_id, run_row
from tests import plugins


def session_for(args: ServerArgs) -> tuple[RankSession, Journal, str]:
    journal = Journal.open_for_write(args.db)
    run_id = new_run_id(time.time())
    journal.create_run(run_row(args, run_id=run_id, created_at=time.time()))
    recorder = Recorder(journal.writer(run_id=run_id, rank=0))
    launch = RankLaunch(run_id=run_id, rank=0, local_ranks=1, distributed=False)
    return RankSession(args, launch, recorder), journal, run_id


def test_the_announcing_event_is_on_disk_before_the_action_runs(tmp_path: Path) -> None:
    """A plug-in pipeline, built inside the load-pipeline action, already finds that action's
    action_started committed, in state gate-check, when read through another connection."""
    db = str(tmp_path / "j.db")
    plugins.DB[:] = [db]
    register_pipeline(*plugins.CHECKING)
    session, _journal, run_id = session_for(ServerArgs(model=plugins.SPEC, db=db))
    assert session.boot() is State.READY
    session.close()
    assert plugins.SEEN["last_event"] == ActionStarted(action="load-pipeline")
    assert plugins.SEEN["last_state"] == "gate-check"
    events = list(Journal.open_for_read(db).read(run_id=run_id))
    start = next(i for i, e in enumerate(events) if isinstance(e.event, Transition))
    assert events[start].event == Transition(trigger="start", source="created", dest="gate-check")
    assert events[start + 1].event == ActionStarted(action="load-pipeline")


def test_a_failing_action_is_journaled_and_fails_the_rank(tmp_path: Path) -> None:
    """An exception inside an action is journaled as a fatal error, then the rank goes to
    failed; the fold shows both."""
    db = str(tmp_path / "j.db")
    args = ServerArgs(model=MODEL_PRESETS["micro-video"], db=db)
    session, _journal, run_id = session_for(args)

    def broken_start() -> None:
        raise RuntimeError("std::get: wrong index for variant")

    session.start = broken_start  # type: ignore[method-assign]
    assert session.boot() is State.FAILED
    session.close()
    events = list(Journal.open_for_read(db).read(run_id=run_id))
    errors = [e.event for e in events if isinstance(e.event, Error)]
    assert [(e.error_type, e.message, e.fatal) for e in errors] == [
        ("RuntimeError", "std::get: wrong index for variant", True)
    ]
    view = fold_run(events)[0]
    assert view.state == "failed"
    assert view.errors[0][1] == "created"


def test_illegal_trigger_is_journaled_and_changes_nothing(tmp_path: Path) -> None:
    """Firing `stop` from created raises, records a non-fatal error event, keeps the state."""
    args = ServerArgs(model=MODEL_PRESETS["micro-video"], db=str(tmp_path / "j.db"))
    session, _journal, run_id = session_for(args)
    with pytest.raises(IllegalTransition):
        session.fire(Trigger.STOP)
    session.close()
    events = list(Journal.open_for_read(args.db).read(run_id=run_id))
    (error,) = [e for e in events if isinstance(e.event, Error)]
    assert error.event.error_type == "IllegalTransition"
    assert error.event.trigger == "stop"
    assert not error.event.fatal
    assert error.state == "created"
    assert fold_run(events)[0].state == "created"


def test_the_actions_cover_exactly_the_states_that_run_actions() -> None:
    """The one declaration of actions names every state the table says runs actions, and no
    other."""
    assert set(STARTUP_ACTIONS) == set(ACTION_STATES)
    assert all(STARTUP_ACTIONS[state] for state in ACTION_STATES)


def test_the_boot_path_logs_each_step_bound_to_run_rank_and_state(tmp_path: Path) -> None:
    """structlog's capture_logs sees, in order, the transitions and actions of a bounded
    startup as log events named by their kind, each bound to the run id, rank and state."""
    from structlog.testing import capture_logs

    args = ServerArgs(
        model=MODEL_PRESETS["micro-video"], db=str(tmp_path / "j.db"), disable_auto_residency=True
    )
    with capture_logs() as logs:
        session, journal, run_id = session_for(args)
        assert session.boot() is State.READY
        session.stop(reason="boot complete")
        session.close()
    journal.close()
    steps = [
        (log["event"], log["state"], log.get("action") or log.get("dest"))
        for log in logs
        if log["event"] in ("transition", "action_started")
    ]
    assert steps == [
        ("transition", "gate-check", "gate-check"),
        ("action_started", "gate-check", "load-pipeline"),
        ("action_started", "gate-check", "check-ranks"),
        ("action_started", "gate-check", "decide-path"),
        ("transition", "bounded-warm", "bounded-warm"),
        ("action_started", "bounded-warm", "apply-reused-residency"),
        ("action_started", "bounded-warm", "bounded-warmup"),
        ("action_started", "bounded-warm", "verify-weights"),
        ("action_started", "bounded-warm", "warm-learned-shapes"),
        ("transition", "ready", "ready"),
        ("action_started", "ready", "mark-ready"),
        ("transition", "stopped", "stopped"),
    ]
    assert {(log["run_id"], log["rank"]) for log in logs} == {(run_id, 0)}
    assert {log["event"] for log in logs} >= {"run_started", "gate_decided", "plan_built"}
