"""Flight Recorder entries as a person reads them: lines for `diagnose` and `show`, and a
track of their own in `trace` (pure)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from replay.flight.dumps import FlightEntry
from replay.flight.join import FlightFacts, FlightStuck, JoinedEntry
from replay.load import RunInfo
from replay.verdict.analysis import RunAnalysis

FLIGHT_TID = 5


def entry_text(entry: FlightEntry) -> str:
    text = f"{entry.op} #{entry.seq} of {entry.group_label}"
    if entry.input_sizes:
        sizes = " ".join("x".join(map(str, s)) or "scalar" for s in entry.input_sizes)
        dtype = f" {entry.dtypes[0].lower()}" if entry.dtypes else ""
        text += f" [{sizes}]{dtype}"
    where = entry.caller
    return f"{text}, called from {where}" if where else text


def _stuck_text(stuck: FlightStuck, analysis: RunAnalysis) -> str:
    j = stuck.joined
    peers = ", ".join(map(str, stuck.waiting_for))
    text = (
        f"rank {j.rank} entered {entry_text(j.entry)} in {j.state} at +{analysis.at(j.at):.2f} s;"
        f" rank {peers} never entered it"
    )
    if stuck.no_dump:
        text += f" (no dump from rank {', '.join(map(str, stuck.no_dump))})"
    return text + ("" if stuck.recorded else " (the lifecycle did not record it)")


def diagnose_lines(facts: FlightFacts, analysis: RunAnalysis) -> list[str]:
    """What the dumps add to a verdict: whose dumps were read, the collectives ranks entered
    and peers never did, and the dumps that could not be read."""
    if not facts.ranks and not facts.problems:
        return []
    lines = ["", "flight recorder:"]
    if facts.ranks:
        lines.append(
            f"  dumps of rank {', '.join(map(str, facts.ranks))}: {len(facts.entries)} entries"
        )
    lines.extend("  " + _stuck_text(s, analysis) for s in facts.stuck)
    return lines


def entries_json(
    facts: FlightFacts, analysis: RunAnalysis, *, ranks: list[int]
) -> dict[str, list[dict[str, Any]]]:
    """Each rank's entries, joined: for `show --json`."""
    stuck = {(s.rank, s.joined.entry.record_id) for s in facts.stuck}
    return {
        str(rank): [
            {
                "at_s": analysis.at(j.at),
                "state": j.state,
                "process_group": j.entry.group_label,
                "lifecycle_group": j.group,
                "seq": j.entry.seq,
                "op": j.entry.op,
                "input_sizes": [list(s) for s in j.entry.input_sizes],
                "output_sizes": [list(s) for s in j.entry.output_sizes],
                "dtypes": list(j.entry.dtypes),
                "finished": j.entry.finished and (rank, j.entry.record_id) not in stuck,
                "caller": j.entry.caller,
            }
            for j in facts.entries
            if j.rank == rank
        ]
        for rank in ranks
        if rank in facts.ranks
    }


def flight_json(facts: FlightFacts, analysis: RunAnalysis) -> dict[str, Any]:
    return {
        "ranks": list(facts.ranks),
        "entries": len(facts.entries),
        "files": {str(rank): list(paths) for rank, paths in facts.sources.items()},
        "stuck": [
            {
                "rank": s.rank,
                "process_group": s.joined.entry.group_label,
                "seq": s.joined.entry.seq,
                "op": s.joined.entry.op,
                "state": s.joined.state,
                "at_s": analysis.at(s.joined.at),
                "lifecycle_group": s.joined.group,
                "recorded": s.recorded,
                "waiting_for": list(s.waiting_for),
                "no_dump": list(s.no_dump),
                "caller": s.joined.entry.caller,
            }
            for s in facts.stuck
        ],
        "problems": list(facts.problems),
    }


def rank_lines(facts: FlightFacts, rank: int, analysis: RunAnalysis, *, last: int) -> list[str]:
    """A rank's Flight Recorder entries for `show`: how many in each state, and its last."""
    mine = [j for j in facts.entries if j.rank == rank]
    if not mine:
        return []
    by_state = Counter(j.state for j in mine)
    files = ", ".join(p.rsplit("/", 1)[-1] for p in facts.sources.get(rank, ()))
    lines = [
        f"  flight recorder ({files}): {len(mine)} entries; "
        + ", ".join(f"{state} {count}" for state, count in by_state.items())
    ]
    stuck = {(s.joined.entry.record_id) for s in facts.stuck if s.rank == rank}
    for j in mine[-last:] if last else ():
        never = " never finished: a peer never entered it" if j.entry.record_id in stuck else ""
        at = f"+{analysis.at(j.at):.3f}"
        lines.append(f"    {at:>10}  {j.state:<14} {entry_text(j.entry)}{never}")
    return lines


def _event(j: JoinedEntry, run: RunInfo, end: float | None, stuck: bool) -> dict[str, Any]:
    ts = round((j.at - run.created_at) * 1e6, 3)
    args = {
        "process_group": j.entry.group_label,
        "seq": j.entry.seq,
        "state": j.state,
        "lifecycle_group": j.group,
        "input_sizes": [list(s) for s in j.entry.input_sizes],
        "caller": j.entry.caller,
        "never_finished": stuck,
    }
    name = f"{j.entry.op} #{j.entry.seq} {j.entry.group_label}"
    if end is None:
        return {"name": name, "ph": "i", "s": "t", "pid": j.rank, "tid": FLIGHT_TID, "ts": ts,
                "args": args}  # fmt: skip
    dur = max(0.0, round((end - j.at) * 1e6, 3))
    return {"name": name, "cat": "flight-recorder", "ph": "X", "pid": j.rank, "tid": FLIGHT_TID,
            "ts": ts, "dur": dur, "args": args}  # fmt: skip


def trace_events(facts: FlightFacts, run: RunInfo, analysis: RunAnalysis) -> list[dict[str, Any]]:
    """Each rank's entries on a "flight recorder" track: spans where the dump timed them (or
    the rank stayed in one until its journal ends), instants where it did not (gloo)."""
    stuck = {(s.rank, s.joined.entry.record_id) for s in facts.stuck}
    events: list[dict[str, Any]] = []
    for rank in facts.ranks:
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": FLIGHT_TID,
                       "args": {"name": "flight recorder"}})  # fmt: skip
    for j in facts.entries:
        offset = j.entry.created_s - j.at  # the rank's clock less the journal's
        never = (j.rank, j.entry.record_id) in stuck
        if j.entry.completed_s is not None:
            end: float | None = j.entry.completed_s - offset
        elif never:
            view = analysis.views.get(j.rank)
            end = view.last_wall if view is not None else None
        else:
            end = None
        events.append(_event(j, run, end, never))
    return events
