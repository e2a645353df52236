"""The fold: a rank's state, path and records rebuilt from its events alone."""

from __future__ import annotations

from lifecycle.core.format import events as ev
from lifecycle.core.format.fold import fold_rank, fold_run


def stream(
    *items: tuple[float, str, ev.Event], rank: int = 0, start_seq: int = 0
) -> list[ev.StoredEvent]:
    return [
        ev.StoredEvent(
            run_id="r", rank=rank, seq=start_seq + i, wall_time=t, mono_ns=i, state=state, event=e
        )
        for i, (t, state, e) in enumerate(items)
    ]


def hop(source: str, dest: str, trigger: str = "t") -> ev.Transition:
    return ev.Transition(trigger=trigger, source=source, dest=dest)


def started(seq: int, group: str = "ulysses0") -> ev.CollectiveStarted:
    return ev.CollectiveStarted(
        group=group, group_ranks=(0, 1), group_seq=seq, op="all_to_all", purpose="ulysses-qkv",
        dtype="float32", shapes=((2, 4),), input_splits=(4, 4), output_splits=(4, 4),
        timeout_s=600.0,
    )  # fmt: skip


def test_path_spans_and_durations_come_from_transitions() -> None:
    """Each transition closes one span and opens the next; the path lists states entered."""
    view = fold_rank(
        stream(
            (10.0, "created", ev.Heartbeat(uptime_s=0, in_state_s=0, pending=None)),
            (11.0, "gate-check", hop("created", "gate-check")),
            (12.5, "bounded-warm", hop("gate-check", "bounded-warm")),
            (15.0, "ready", hop("bounded-warm", "ready")),
        )
    )
    assert view.path == ("created", "gate-check", "bounded-warm", "ready")
    assert [(s.state, s.duration_s()) for s in view.spans[:-1]] == [
        ("created", 1.0), ("gate-check", 1.5), ("bounded-warm", 2.5)
    ]  # fmt: skip
    assert view.spans[-1].left_at is None
    assert view.time_in_state_s(now=20.0) == 5.0
    assert view.entered_at("bounded-warm") == 12.5
    assert not view.healthy


def test_healthy_needs_the_ready_action_done() -> None:
    """A rank is healthy once its ready action finished, not at the transition."""
    events = stream(
        (1.0, "ready", hop("bounded-warm", "ready")),
        (1.1, "ready", ev.ActionStarted(action="mark-ready")),
    )
    assert not fold_rank(events).healthy
    events += stream(
        (1.2, "ready", ev.ActionFinished(action="mark-ready", duration_s=0.1, ok=True)), start_seq=2
    )
    assert fold_rank(events).healthy


def test_an_open_collective_is_pending_until_finished() -> None:
    """The newest started-but-unfinished collective is pending; group progress tracks seqs."""
    finished = ev.CollectiveFinished(group="ulysses0", group_seq=0, op="all_to_all", duration_s=0.1)
    events = stream(
        (1.0, "ready", started(0)), (1.1, "ready", finished), (1.2, "ready", started(1))
    )
    view = fold_rank(events)
    assert view.pending is not None and view.pending.started.group_seq == 1
    (group,) = view.groups
    assert (group.group, group.started, group.finished, group.count) == ("ulysses0", 1, 0, 2)


def test_buffers_live_bytes_follow_allocations_and_drops() -> None:
    """Allocation sets the live bytes, a drop zeroes them; both are kept with their state."""
    alloc = ev.BuffersAllocated(
        purpose="ulysses-qkv", key="k", shape=(2, 3), dtype="float32", bytes=24, live_bytes=24
    )
    drop = ev.BuffersDropped(buffers=1, bytes_freed=24, keys=("k",), allocator_released_bytes=None)
    view = fold_rank(stream((1.0, "probe", alloc), (2.0, "drop-buffers", drop)))
    assert view.live_buffer_bytes == 0
    assert view.buffer_drops[0][1] == "drop-buffers"
    assert fold_rank(stream((1.0, "probe", alloc))).live_buffer_bytes == 24


def test_fold_until_rebuilds_the_state_at_a_moment() -> None:
    """Folding with `until` gives each rank's state as it was at that wall time."""
    events = stream(
        (1.0, "gate-check", hop("created", "gate-check")),
        (2.0, "bounded-warm", hop("gate-check", "bounded-warm")),
    ) + stream((1.5, "gate-check", hop("created", "gate-check")), rank=1)
    assert {r: v.state for r, v in fold_run(events, until=1.2).items()} == {0: "gate-check"}
    assert {r: v.state for r, v in fold_run(events, until=1.7).items()} == {
        0: "gate-check", 1: "gate-check"
    }  # fmt: skip
    assert fold_run(events)[0].state == "bounded-warm"


def test_gaps_and_unknown_events_are_reported_not_fatal() -> None:
    """A missing seq and an undecodable row are noted in the view; folding goes on."""
    unknown = ev.UnknownEvent(row_kind="x", row_version=1, reason="unknown kind", raw="{}")
    events = stream((1.0, "created", unknown)) + stream(
        (2.0, "gate-check", hop("created", "gate-check")), start_seq=3
    )
    view = fold_rank(events)
    assert view.unknown == (unknown,)
    assert [(g.expected, g.found) for g in view.seq_gaps] == [(1, 3)]
    assert view.state == "gate-check"


def test_plan_sets_the_skip_reason() -> None:
    """The plan's skip reason is the rank's final decision."""
    plan = ev.PlanBuilt(skip_reason="residency planner not available", requests=(), probe_fit=None)
    assert fold_rank(stream((1.0, "gate-check", plan))).skip_reason == plan.skip_reason


def test_collective_records_dumped_after_a_stop_do_not_move_the_state_back() -> None:
    """A dump of the ring writes records stamped with the state they ran in (ready) after the
    rank stopped: they count as collectives, and the rank stays stopped."""
    view = fold_rank(
        stream(
            (1.0, "ready", hop("created", "ready")),
            (2.0, "stopped", hop("ready", "stopped")),
            (1.5, "ready", started(7)),
            (
                1.6,
                "ready",
                ev.CollectiveFinished(
                    group="ulysses0", group_seq=7, op="all_to_all", duration_s=0.1
                ),
            ),
        )
    )
    assert view.state == "stopped"
    assert view.path == ("created", "ready", "stopped")
    assert [(g.group, g.started, g.finished) for g in view.groups] == [("ulysses0", 7, 7)]
