"""Several real rank processes over gloo, started by `lifecycle boot`."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from lifecycle.core.format.events import (
    CollectiveFinished,
    CollectiveStarted,
    Error,
    FaultInjected,
    Heartbeat,
    Stalled,
    StoredEvent,
    Transition,
)
from lifecycle.core.format.fold import fold_run
from lifecycle.store.journal import Journal
from tests.conftest import Completed
from tests.support.torchrun import torchrun_boot

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

MICRO = ["--model", "micro-video", "--db", "j.db", "--log-level", "warning"]


def run_events(db: Path) -> list[StoredEvent]:
    journal = Journal.open_for_read(str(db))
    (run,) = journal.runs()
    return list(journal.read(run_id=run.run_id))


def by_rank(events: list[StoredEvent]) -> dict[int, list[StoredEvent]]:
    out: dict[int, list[StoredEvent]] = defaultdict(list)
    for stored in events:
        out[stored.rank].append(stored)
    return out


def failed_boot(
    lifecycle_cli: Callable[..., Completed],
    db: Path,
    *options: str,
    timeout: float,
    env: dict[str, str] | None = None,
) -> tuple[Completed, dict[int, list[StoredEvent]]]:
    """`lifecycle boot` of the micro model with `options`, which must exit 1; its result and
    the journal's events by rank."""
    result = lifecycle_cli("boot", *MICRO, *options, timeout=timeout, env=env)
    assert result.returncode == 1
    return result, by_rank(run_events(db))


CALIBRATED = ["gate-check", "bounded-warm", "probe", "re-warm", "drop-buffers", "ready", "stopped"]


def path_of(events: list[StoredEvent]) -> list[str]:
    return [e.event.dest for e in events if isinstance(e.event, Transition)]


def collective_signatures(events: list[StoredEvent]) -> dict[str, list[tuple[object, ...]]]:
    """Per group, the (seq, op, purpose, dtype, finished) of every collective this rank ran."""
    finished = {
        (e.event.group, e.event.group_seq)
        for e in events
        if isinstance(e.event, CollectiveFinished)
    }
    out: dict[str, list[tuple[object, ...]]] = defaultdict(list)
    for e in events:
        if isinstance(e.event, CollectiveStarted):
            c = e.event
            out[c.group].append(
                (c.group_seq, c.op, c.purpose, c.dtype, (c.group, c.group_seq) in finished)
            )
    return out


@pytest.mark.parametrize(
    ("layout", "calibrate"),
    [
        pytest.param(["--num-ranks", "2", "--ulysses", "2"], False, marks=pytest.mark.slow),
        (["--num-ranks", "2", "--ulysses", "2"], True),
        pytest.param(
            ["--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2"],
            False,
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ["--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2"],
            True,
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "ulysses2-bounded",
        "ulysses2-calibrated",
        "cfg2xulysses2-bounded",
        "cfg2xulysses2-calibrated",
    ],
)
def test_every_rank_reaches_ready_in_step(
    tmp_path: Path,
    lifecycle_cli: Callable[..., Completed],
    layout: list[str],
    calibrate: bool,
) -> None:
    """Every rank walks the same states in the same order, and in each group every member ran
    the same collectives at the same sequence numbers, all finished."""
    # Bounded: auto residency disabled; calibrated: --calibrate (the planner plans as well).
    args = [*MICRO, *layout, *(["--calibrate"] if calibrate else [])]
    env = None if calibrate else {"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1"}
    result = lifecycle_cli("boot", *args, timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    ranks = by_rank(run_events(tmp_path / "j.db"))
    world = int(layout[1])
    assert sorted(ranks) == list(range(world))
    expected = ["gate-check", "bounded-warm"]
    expected += ["probe", "re-warm", "drop-buffers"] if calibrate else []
    expected += ["ready", "stopped"]
    for events in ranks.values():
        assert path_of(events) == expected
    signatures = {rank: collective_signatures(events) for rank, events in ranks.items()}
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, per_group in signatures.items():
        for group in per_group:
            groups[group].append(rank)
    assert "world" in groups and any(g.startswith("ulysses") for g in groups)
    if "--cfg-parallel" in layout:
        assert any(g.startswith("cfg") for g in groups)
    for group, members in groups.items():
        assert len(members) > 1, group
        reference = signatures[members[0]][group]
        assert [s[0] for s in reference] == list(range(len(reference)))
        assert all(s[-1] for s in reference), f"unfinished collective in {group}"
        for rank in members[1:]:
            assert signatures[rank][group] == reference, (group, rank)


def test_the_fields_failure_is_reproduced(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """4 ranks, --calibrate, rank 1 raising in drop-buffers, and the field's behaviour of
    waiting for the collective's own timeout (`--on-peer-failure wait`): rank 1 ends failed
    with its error in drop-buffers; its peers block in a later all-to-all (started, never
    finished) until the process-group timeout, journal the timeout, and the launcher exits 1
    within the timeout plus a bounded margin. (The default, the agreed abort, is
    tests/lifecycle/test_abort.py.)"""
    timeout = 5
    # Bounded: the launcher must end the run within the timeout plus a margin, or the
    # command's own timeout fails the test.
    _, ranks = failed_boot(
        lifecycle_cli, tmp_path / "j.db", "--num-ranks", "4", "--cfg-parallel", "2",
        "--ulysses", "2", "--calibrate", "--fault", "1:drop-buffers:raise",
        "--dist-timeout", str(timeout), "--on-peer-failure", "wait", timeout=60 + timeout,
    )  # fmt: skip
    culprit = fold_run(ranks[1])[1]
    assert culprit.state == "failed"
    assert [(state, e.error_type) for _, state, e in culprit.errors] == [
        ("drop-buffers", "InjectedFault")
    ]
    assert [f.fault for _, _, f in culprit.faults] == ["1:drop-buffers:raise"]
    for rank in (0, 2, 3):
        events = ranks[rank]
        view = fold_run(events)[rank]
        assert view.state == "failed"
        assert view.pending is not None, rank
        assert view.pending.started.op == "all_to_all"
        assert "drop-buffers" in view.path
        error_at = next(i for i, e in enumerate(events) if isinstance(e.event, Error))
        pending_at = next(
            i for i, e in enumerate(events)
            if isinstance(e.event, CollectiveStarted)
            and e.event.group == view.pending.started.group
            and e.event.group_seq == view.pending.started.group_seq
        )  # fmt: skip
        assert pending_at < error_at
        error = events[error_at].event
        assert isinstance(error, Error)
        assert error.error_type == "CollectiveTimeout"
        assert f"#{view.pending.started.group_seq}" in error.message


def test_an_exiting_rank_leaves_its_state_behind(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A rank that dies at once in bounded-warm: its journal ends with the fault in that
    state; the peer fails on the broken collective; the launcher exits 1."""
    result, ranks = failed_boot(
        lifecycle_cli, tmp_path / "j.db", "--num-ranks", "2", "--fault", "1:bounded-warm:exit",
        "--dist-timeout", "10", timeout=120,
    )  # fmt: skip
    last = ranks[1][-1]
    assert isinstance(last.event, FaultInjected)
    assert (last.state, last.event.fault_kind) == ("bounded-warm", "exit")
    assert fold_run(ranks[0])[0].state == "failed"
    assert "rank 1: bounded-warm" in result.stdout


# Slow tier: a silent hang stalled at its deadline, with heartbeats, is the default run's
# (tests/lifecycle/test_history.py).
@pytest.mark.slow
def test_a_hanging_rank_keeps_its_heartbeat_and_reports_a_stall(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A rank that hangs in bounded-warm goes on heartbeating and journals one stall with
    every thread's stack; its peer times out, and the hung rank, still in bounded-warm, is
    aborted by that failure; the launcher ends both and exits 1."""
    _, ranks = failed_boot(
        lifecycle_cli, tmp_path / "j.db", "--num-ranks", "2", "--fault", "1:bounded-warm:hang",
        "--dist-timeout", "4", "--heartbeat-interval", "0.2", "--state-deadline", "2",
        timeout=120,
    )  # fmt: skip
    hung = ranks[1]
    fault_at = next(i for i, e in enumerate(hung) if isinstance(e.event, FaultInjected))
    after = hung[fault_at + 1 :]
    assert sum(isinstance(e.event, Heartbeat) for e in after) >= 5
    stalls = [e for e in after if isinstance(e.event, Stalled)]
    assert len(stalls) == 1
    assert stalls[0].state == "bounded-warm"
    assert any("inject_on_entering" in t.stack for t in stalls[0].event.threads)
    hung_view = fold_run(hung)[1]
    assert list(hung_view.path[-2:]) == ["bounded-warm", "failed"]
    assert [(state, a.failed_rank) for _, state, a in hung_view.aborts] == [("bounded-warm", 0)]
    peer = fold_run(ranks[0])[0]
    assert peer.state == "failed"
    assert peer.errors[0][2].error_type == "CollectiveTimeout"


@pytest.mark.slow
def test_a_skipped_collective_leaves_the_ranks_out_of_step(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """A rank that skips gate-check's first collective (the world's gather of the ranks'
    environments, docs/ranks.md) is journaled with the collective it skipped; its peer is left
    waiting at that sequence number until a failure stops it (its own timeout, or the agreed
    abort when the skipping rank fails first); the launcher exits 1."""
    _, ranks = failed_boot(
        lifecycle_cli, tmp_path / "j.db", "--num-ranks", "2", "--fault",
        "1:gate-check:skip-collective", "--dist-timeout", "4", timeout=120,
        env={"LIFECYCLE_DISABLE_AUTO_RESIDENCY": "1"},
    )  # fmt: skip
    (skip,) = [e for e in ranks[1] if isinstance(e.event, FaultInjected)]
    assert skip.state == "gate-check"
    assert "(all_gather #0 in world)" in skip.event.fault
    waiting = fold_run(ranks[0])[0]
    assert waiting.state == "failed"
    stopped_in = [state for _, state, _ in waiting.errors] + [s for _, s, _ in waiting.aborts]
    assert stopped_in[:1] == ["gate-check"], (waiting.errors, waiting.aborts)
    world = {g.group: g for g in waiting.groups}["world"]
    assert (world.started, world.finished) == (0, -1)


def test_a_fault_for_a_rank_that_does_not_exist_is_refused_before_start(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """`--fault 5:probe:raise` on 2 ranks is one line, exit 2, and no rank starts."""
    result = lifecycle_cli(
        "boot", *MICRO, "--num-ranks", "2", "--fault", "5:probe:raise", timeout=60
    )
    assert result.returncode == 2
    assert "rank 5 is outside 0..1" in result.stderr
    assert not (tmp_path / "j.db").exists()


def test_faults_also_come_from_the_environment(
    tmp_path: Path, lifecycle_cli: Callable[..., Completed]
) -> None:
    """LIFECYCLE_FAULTS adds faults like --fault; they are recorded in the run's config."""
    result = lifecycle_cli(
        "boot", *MICRO, env={"LIFECYCLE_FAULTS": "0:gate-check:raise"}, timeout=120
    )
    assert result.returncode == 1
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    (run,) = journal.runs()
    assert run.config["faults"] == ["0:gate-check:raise"]


def test_torchrun_starts_the_same_entry(tmp_path: Path) -> None:
    """Under torchrun each process is one rank; all ranks share one run id, derived from
    torchrun's rendezvous id (a UUID under --standalone) in the one form; rank 0 prints the
    boot's table."""
    proc = torchrun_boot(tmp_path, 2, *MICRO, "--num-ranks", "2", env={"OMP_NUM_THREADS": "1"})
    # Auto mode: micro-video declares residency options, so the first startup calibrates.
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = run_events(tmp_path / "j.db")
    ranks = by_rank(events)
    assert sorted(ranks) == [0, 1]
    for rank_events in ranks.values():
        assert path_of(rank_events) == CALIBRATED
    assert re.fullmatch(r"torchrun-[0-9a-f]{14}", events[0].run_id), events[0].run_id
    # Rank 0 prints its table, once; no other rank prints one.
    assert proc.stdout.count(f"run {events[0].run_id}  model micro-video  ranks 2 (torchrun)") == 1
    assert proc.stdout.count("startup to ready") == 1, proc.stdout
