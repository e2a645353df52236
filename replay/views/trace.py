"""A run as Chrome Trace Event JSON, for chrome://tracing and Perfetto (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lifecycle.core.format.events import (
    ActionFinished,
    ActionStarted,
    BuffersAllocated,
    BuffersDropped,
    CollectiveFinished,
    CollectiveStarted,
    Error,
    FaultInjected,
    Heartbeat,
    RequestFinished,
    RequestStarted,
    Stalled,
    StoredEvent,
    Transition,
    WarmupRecord,
)
from lifecycle.core.format.states import State
from replay.load import RunInfo

STATES_TID = 1
ACTIONS_TID = 2
COLLECTIVES_TID = 3
REQUESTS_TID = 4
THREADS = {
    STATES_TID: "states",
    ACTIONS_TID: "actions",
    COLLECTIVES_TID: "collectives",
    REQUESTS_TID: "requests",
}
MIB = 2**20


@dataclass
class _Open:
    name: str
    ts: float
    args: dict[str, Any]


@dataclass
class _RankTrace:
    rank: int
    events: list[dict[str, Any]] = field(default_factory=list)
    state: _Open | None = None
    action: _Open | None = None
    requests: dict[str, _Open] = field(default_factory=dict)
    collectives: dict[str, tuple[_Open, int]] = field(default_factory=dict)
    last_ts: float = 0.0


def build_trace(run: RunInfo, events: Iterable[StoredEvent]) -> dict[str, Any]:
    """One process per rank; states, actions, collectives and requests as closed spans on their
    own threads; flow arrows joining each collective across ranks; heartbeats, errors, faults
    and stalls as instants; memory and staging buffers as counters."""
    ranks: dict[int, _RankTrace] = {}
    flows: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for stored in events:
        ts = round((stored.wall_time - run.created_at) * 1e6, 3)
        rank = ranks.get(stored.rank)
        if rank is None:
            rank = ranks[stored.rank] = _RankTrace(rank=stored.rank)
            rank.state = _Open(name=State.CREATED.value, ts=ts, args={})
        rank.last_ts = max(rank.last_ts, ts)
        event = stored.event
        # An arrow joins ranks, so its ends are gathered across every rank's events.
        if isinstance(event, CollectiveStarted):
            flows.setdefault((event.group, event.group_seq), []).append((stored.rank, ts))
        _follow_spans(rank, stored, ts)
        rank.events.extend(_marks(stored, ts))
    trace_events: list[dict[str, Any]] = []
    for rank in ranks.values():
        _close_at_end(rank)
        trace_events.extend(_metadata(rank.rank))
        trace_events.extend(rank.events)
    trace_events.extend(_flow_arrows(flows))
    return {
        "traceEvents": trace_events,
        "displayTimeUnit": "ms",
        "otherData": {
            "run_id": run.run_id,
            "created_at": run.created_at,
            "world_size": run.world_size,
            "host": run.host,
        },
    }


def _follow_spans(rank: _RankTrace, stored: StoredEvent, ts: float) -> None:
    """Open or close the rank's state, action, request and collective spans at this event."""
    event = stored.event
    match event:
        case Transition():
            _close(rank, rank.state, ts, STATES_TID, "state")
            rank.state = _Open(name=event.dest, ts=ts, args={"trigger": event.trigger})
        case ActionStarted():
            rank.action = _Open(name=event.action, ts=ts, args={"state": stored.state})
        case ActionFinished():
            if rank.action is not None:
                rank.action.args["ok"] = event.ok
                _close(rank, rank.action, ts, ACTIONS_TID, "action")
                rank.action = None
        case RequestStarted():
            rank.requests[event.request_id] = _Open(
                name=f"{event.source} {event.shape}",
                ts=ts,
                args={"steps": event.steps, "request_id": event.request_id},
            )
        case RequestFinished():
            opened = rank.requests.pop(event.request_id, None)
            if opened is not None:
                opened.args.update(ok=event.ok, checksum=event.checksum)
                _close(rank, opened, ts, REQUESTS_TID, "request")
        case CollectiveStarted():
            rank.collectives[event.group] = (_collective_span(event, ts), event.group_seq)
        case CollectiveFinished():
            opened_c = rank.collectives.get(event.group)
            if opened_c is not None and opened_c[1] == event.group_seq:
                _close(rank, opened_c[0], ts, COLLECTIVES_TID, "collective")
                del rank.collectives[event.group]
        case _:
            pass


def _collective_span(event: CollectiveStarted, ts: float) -> _Open:
    """The span a collective opens, named by its op, group and place in the group."""
    return _Open(
        name=f"{event.op} {event.group}#{event.group_seq}",
        ts=ts,
        args={
            "group": event.group,
            "group_ranks": list(event.group_ranks),
            "group_seq": event.group_seq,
            "purpose": event.purpose,
            "dtype": event.dtype,
            "shapes": [list(s) for s in event.shapes],
            "input_splits": event.input_splits,
            "output_splits": event.output_splits,
        },
    )


def _marks(stored: StoredEvent, ts: float) -> list[dict[str, Any]]:
    """The instants and counters this event puts on its rank's process (none for most)."""
    event = stored.event
    match event:
        case WarmupRecord():
            return [
                _counter(stored.rank, ts, "memory", {
                    "peak_MiB": (event.peak_bytes or 0) / MIB,
                    "baseline_MiB": (event.baseline_bytes or 0) / MIB,
                }),
                _instant(stored.rank, ts, f"warmup {event.role}", REQUESTS_TID, "t", {
                    "shape": str(event.shape),
                    "steps": event.steps, "total_s": event.total_s,
                    "memory_source": event.memory_source,
                }),
            ]  # fmt: skip
        case BuffersAllocated():
            return [
                _counter(stored.rank, ts, "staging buffers", {"live_MiB": event.live_bytes / MIB})
            ]
        case BuffersDropped():
            return [
                _counter(stored.rank, ts, "staging buffers", {"live_MiB": 0.0}),
                _instant(stored.rank, ts, "buffers dropped", STATES_TID, "t",
                         {"bytes_freed": event.bytes_freed, "buffers": event.buffers}),
            ]  # fmt: skip
        case Heartbeat():
            return [_instant(stored.rank, ts, "heartbeat", STATES_TID, "t", {
                "state": stored.state,
                "pending": None if event.pending is None else
                f"{event.pending.op} {event.pending.group}#{event.pending.group_seq}",
            })]  # fmt: skip
        case Error():
            args = {"message": event.message, "kind": event.error_kind, "state": stored.state,
                    "fatal": event.fatal}  # fmt: skip
            name = f"error {event.error_type}"
            return [_instant(stored.rank, ts, name, STATES_TID, "p", args)]
        case FaultInjected():
            return [_instant(stored.rank, ts, "fault", STATES_TID, "p", {"fault": event.fault})]
        case Stalled():
            return [_instant(stored.rank, ts, "stalled", STATES_TID, "p",
                             {"in_state_s": event.in_state_s})]  # fmt: skip
        case _:
            return []


def _close_at_end(rank: _RankTrace) -> None:
    """Close what is still open at the rank's last event; a state other than stopped or failed,
    and any action, request or collective, is marked unfinished."""
    end = rank.last_ts
    ended = rank.state is None or rank.state.name in (State.STOPPED.value, State.FAILED.value)
    _close(rank, rank.state, end, STATES_TID, "state", unfinished=not ended)
    _close(rank, rank.action, end, ACTIONS_TID, "action", unfinished=True)
    for opened in rank.requests.values():
        _close(rank, opened, end, REQUESTS_TID, "request", unfinished=True)
    for opened, _ in rank.collectives.values():
        _close(rank, opened, end, COLLECTIVES_TID, "collective", unfinished=True)


def _flow_arrows(flows: dict[tuple[str, int], list[tuple[int, float]]]) -> list[dict[str, Any]]:
    """Each collective that more than one rank started, as an arrow from the first rank to start
    it, through the others, to the last."""
    arrows: list[dict[str, Any]] = []
    for index, ((group, seq), members) in enumerate(sorted(flows.items())):
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda m: m[1])
        for position, (rank_id, ts) in enumerate(ordered):
            phase = "s" if position == 0 else "f" if position == len(ordered) - 1 else "t"
            flow: dict[str, Any] = {
                "name": f"{group}#{seq}",
                "cat": "collective",
                "ph": phase,
                "id": index + 1,
                "pid": rank_id,
                "tid": COLLECTIVES_TID,
                "ts": ts,
            }
            if phase == "f":
                flow["bp"] = "e"
            arrows.append(flow)
    return arrows


def _close(
    rank: _RankTrace,
    opened: _Open | None,
    ts: float,
    tid: int,
    cat: str,
    *,
    unfinished: bool = False,
) -> None:
    if opened is None:
        return
    args = dict(opened.args)
    if unfinished:
        args["unfinished"] = True
    rank.events.append(
        {
            "name": opened.name,
            "cat": cat,
            "ph": "X",
            "pid": rank.rank,
            "tid": tid,
            "ts": opened.ts,
            "dur": max(0.0, round(ts - opened.ts, 3)),
            "args": args,
        }
    )


def _instant(
    pid: int, ts: float, name: str, tid: int, scope: str, args: dict[str, Any]
) -> dict[str, Any]:
    return {"name": name, "ph": "i", "s": scope, "pid": pid, "tid": tid, "ts": ts, "args": args}


def _counter(pid: int, ts: float, name: str, args: dict[str, float]) -> dict[str, Any]:
    return {"name": name, "ph": "C", "pid": pid, "ts": ts, "args": args}


def _metadata(rank: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    for tid, name in THREADS.items():
        out.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
        )
        out.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
    return out
