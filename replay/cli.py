"""The `replay` command: read lifecycle journals after the fact and say what happened.

This module imports neither torch nor the journal at import time, so `replay --help` is
instant; each command imports what it reads with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from replay.exits import ReplayExit, Usage
from replay.parser import parse_args

if TYPE_CHECKING:
    from lifecycle.core.format.view import RankView
    from replay.flight.join import FlightFacts
    from replay.load import Journals, RunInfo
    from replay.verdict.diagnose import Diagnosis


def _now(ns: argparse.Namespace) -> float:
    return time.time() if ns.now is None else float(ns.now)


def _style(out: IO[str]) -> Any:
    from replay.views.render import Style

    # https://no-color.org: NO_COLOR present and not empty turns colour off.
    return Style(color=out.isatty() and not os.environ.get("NO_COLOR"))


def _locations(given: Sequence[str]) -> list[str]:
    """The journals named, else the one `lifecycle boot` writes by default, which must exist:
    replay reads and never creates one."""
    if given:
        return list(given)
    from lifecycle.core.command import JOURNAL_ENV, default_journal
    from lifecycle.store.location import is_url, shown_location

    location = default_journal(os.environ)
    if not is_url(location) and not os.path.exists(os.path.expanduser(location)):
        named = os.environ.get(JOURNAL_ENV)
        where = f"${JOURNAL_ENV} ({shown_location(location)})" if named else f"./{location}"
        raise Usage(f"no JOURNAL given, and {where} does not exist: name a JOURNAL")
    return [location]


def _warn(problems: list[str], err: IO[str]) -> None:
    from lifecycle.core.format.text import clean

    for problem in dict.fromkeys(problems):
        print(f"replay: warning: {clean(problem)}", file=err)


def _dump(doc: object, out: IO[str]) -> None:
    json.dump(doc, out, indent=2, default=str)
    out.write("\n")


def _flight(
    journals: Journals, run: RunInfo, views: Mapping[int, RankView], folder: str | None
) -> FlightFacts | None:
    """The run's Flight Recorder dumps joined with it; a dump that cannot be read is one
    warning line, and the rest is read without it."""
    from replay.flight.dumps import dumps_for
    from replay.flight.join import join

    if folder is not None and not os.path.isdir(folder):
        raise Usage(f"--flight-recorder {folder}: no such folder")
    dumps = dumps_for(run.run_id, views, None if folder is None else Path(folder))
    if dumps is None:
        return None
    journals.problems.extend(f"flight recorder: {p}" for p in dumps.problems)
    return join(views, dumps, world_size=run.world_size)


def _diagnosis(
    journals: Journals,
    run: RunInfo,
    now: float,
    *,
    check: bool = True,
    flight: bool = False,
    flight_dir: str | None = None,
) -> tuple[Diagnosis, FlightFacts | None]:
    """The run's verdict, from each rank's summary and the events after it: the same verdict
    as from every event, at the cost of what the summaries hold (see Journals.views). With
    `flight`, joined with the Flight Recorder's dumps (in `flight_dir`, else as journaled),
    which come back with it."""
    from replay.verdict.analysis import combine
    from replay.verdict.diagnose import diagnose
    from replay.verdict.liveness import dead_ranks, live_ranks

    views = journals.views(run, check=check)
    analysis = combine(run, views)
    facts = _flight(journals, run, views, flight_dir) if flight else None
    diagnosis = diagnose(
        analysis,
        now=now,
        dead_ranks=dead_ranks(analysis),
        live_ranks=live_ranks(analysis),
        flight=facts,
    )
    return diagnosis, facts


def cmd_runs(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.history import history_rows
    from replay.load import Journals
    from replay.views.runs import (
        format_runs,
        journaled_paths,
        runs_json,
        summarize_run,
        summarize_settled,
    )

    with Journals.open(_locations(ns.journals)) as journals:
        now = _now(ns)
        journals.prefetch_summaries()
        paths = journaled_paths(history_rows(journals, say_older=False))
        summaries = []
        for run in journals.runs():
            # A run every rank of which ended healthy is `ready` from its summaries alone.
            settled = journals.settled(run)
            summaries.append(
                summarize_settled(run, settled, journaled=paths.get(run.run_id))
                if settled is not None
                else summarize_run(run, _diagnosis(journals, run, now, check=False)[0])
            )
        _warn(journals.problems, err)
    if ns.json:
        _dump(runs_json(summaries), out)
    else:
        print(format_runs(summaries, _style(out)) if summaries else "no runs", file=out)
    return ReplayExit.OK


def cmd_show(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.flight.view import entries_json, rank_lines
    from replay.load import Journals
    from replay.verdict.analysis import analyze, combine
    from replay.views.rankchecks import group_checks, host_lines
    from replay.views.timeline import (
        event_line,
        format_at,
        format_header,
        format_rank,
        missing_line,
    )
    from replay.views.timelinejson import show_json

    with Journals.open(_locations(ns.journals)) as journals:
        run = journals.resolve(ns.run)
        if ns.at is not None:
            analysis = analyze(run, journals.events(run), until=run.created_at + ns.at)
            _warn(journals.problems, err)
            if ns.json:
                _dump(show_json(analysis, ranks=ns.rank, at=ns.at, collectives={}), out)
            else:
                print(format_at(analysis, seconds=ns.at), file=out)
            return ReplayExit.OK
        style = _style(out)
        if not ns.json:
            # The first line before anything is read: a huge run starts showing at once.
            print(format_header(run, style), file=out, flush=True)
        analysis = combine(run, journals.views(run))
        facts = _flight(journals, run, analysis.views, ns.flight_recorder)
        chosen = [r for r in analysis.views if ns.rank is None or r in ns.rank]
        if not ns.json and (hosts := host_lines(analysis.views, chosen)):
            print("\n" + "\n".join(hosts), file=out, flush=True)
        if ns.json:
            last = {r: journals.last_collectives(run, r, ns.last) for r in chosen}
            _warn(journals.problems, err)
            doc = show_json(analysis, ranks=ns.rank, at=None, collectives=last)
            if facts is not None:
                doc["flight_recorder"] = entries_json(facts, analysis, ranks=chosen)
            _dump(doc, out)
            return ReplayExit.OK
        checks = group_checks(analysis.views)
        for rank in chosen:
            view = analysis.views[rank]
            if ns.all:
                lines = format_rank(view, analysis, style, None, checks=checks)
                print("\n" + "\n".join(lines), file=out)
                for stored in journals.events(run, rank=rank):
                    print("  " + event_line(stored, analysis), file=out)
            else:
                last_records = journals.last_collectives(run, rank, ns.last)
                lines = format_rank(view, analysis, style, last_records, checks=checks)
                if facts is not None:
                    lines.extend(rank_lines(facts, rank, analysis, last=ns.last))
                print("\n" + "\n".join(lines), file=out, flush=True)
        if analysis.missing_ranks and ns.rank is None:
            print("\n" + missing_line(analysis), file=out)
        _warn(journals.problems, err)
    return ReplayExit.OK


def cmd_diagnose(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.flight.view import diagnose_lines, flight_json
    from replay.load import Journals
    from replay.verdict.diagnose import exit_status
    from replay.views.diagnosis import diagnosis_json, format_diagnosis

    with Journals.open(_locations(ns.journals)) as journals:
        run = journals.resolve(ns.run)
        diagnosis, facts = _diagnosis(
            journals, run, _now(ns), flight=True, flight_dir=ns.flight_recorder
        )
        _warn(journals.problems, err)
    if ns.json:
        doc = diagnosis_json(diagnosis)
        if facts is not None:
            doc["flight_recorder"] = flight_json(facts, diagnosis.analysis)
        _dump(doc, out)
    else:
        text = format_diagnosis(diagnosis, _style(out))
        if facts is not None:
            text = "\n".join([text, *diagnose_lines(facts, diagnosis.analysis)])
        print(text, file=out)
    return exit_status(diagnosis)


def cmd_verify(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.load import Journals
    from replay.verify import format_verify, verify_json, verify_run

    targets = list(ns.targets)
    if not ns.all and not targets:
        raise Usage("verify needs RUN, or --all to check every run")
    with Journals.open(_locations(targets if ns.all else targets[1:])) as journals:
        runs = journals.runs() if ns.all else [journals.resolve(targets[0])]
        reports = [verify_run(run, journals.events(run)) for run in runs]
        _warn(journals.problems, err)
    if ns.json:
        _dump(verify_json(reports), out)
    else:
        print(format_verify(reports) if reports else "no runs", file=out)
    return ReplayExit.OK if all(r.consistent for r in reports) else ReplayExit.FAILURE


def cmd_trace(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.flight.view import trace_events
    from replay.load import Journals
    from replay.output import trace_target, write_replacing
    from replay.verdict.analysis import combine
    from replay.views.trace import build_trace

    locations = _locations(ns.journals)
    target = None if ns.output == "-" else trace_target(ns.output, locations)
    with Journals.open(locations) as journals:
        run = journals.resolve(ns.run)
        trace = build_trace(run, journals.events(run))
        views = journals.views(run)
        facts = _flight(journals, run, views, ns.flight_recorder)
        if facts is not None:
            trace["traceEvents"].extend(trace_events(facts, run, combine(run, views)))
        _warn(journals.problems, err)
    if target is None:
        json.dump(trace, out)
        out.write("\n")
        return ReplayExit.OK
    write_replacing(target, trace, output=ns.output)
    spans = sum(1 for e in trace["traceEvents"] if e.get("ph") == "X")
    if ns.json:
        _dump({"run_id": run.run_id, "output": str(target), "events": len(trace["traceEvents"]),
               "spans": spans}, out)  # fmt: skip
    else:
        print(f"wrote {ns.output}: {len(trace['traceEvents'])} trace events, {spans} spans,"
              f" run {run.run_id}", file=out)  # fmt: skip
    return ReplayExit.OK


def cmd_diff(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.diff import diff_json, format_diff, profile
    from replay.load import Journals

    with Journals.open(_locations(ns.journals)) as journals:
        now = _now(ns)
        profiles = []
        for ref in (ns.run_a, ns.run_b):
            run = journals.resolve(ref)
            profiles.append(profile(_diagnosis(journals, run, now)[0]))
        _warn(journals.problems, err)
    a, b = profiles
    if ns.json:
        _dump(diff_json(a, b), out)
    else:
        print(format_diff(a, b), file=out)
    return ReplayExit.OK


def cmd_history(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from replay.gatehistory import format_gate_figures, gate_figures, gate_figures_json
    from replay.history import format_history, histories, history_json, history_rows
    from replay.load import Journals

    with Journals.open(_locations(ns.journals)) as journals:
        runs = journals.runs()
        found_histories = histories(runs, history_rows(journals, say_older=True))
        figures = gate_figures(journals, runs)
        _warn(journals.problems, err)
    if ns.json:
        _dump({**history_json(found_histories), "gate_figures": gate_figures_json(figures)}, out)
    else:
        style = _style(out)
        text = format_history(found_histories, style)
        if figures:
            text += "\n\n" + format_gate_figures(figures, style)
        print(text, file=out)
    return ReplayExit.OK


def cmd_completion(ns: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    from lifecycle.core.command import completion_script
    from replay.parser import build_parser

    script = completion_script(
        build_parser(),
        ns.shell,
        files=frozenset({"journals", "targets", "--output"}),
        folders=frozenset({"--flight-recorder"}),
    )
    out.write(script)
    return ReplayExit.OK


COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str], IO[str]], int]] = {
    "runs": cmd_runs,
    "show": cmd_show,
    "diagnose": cmd_diagnose,
    "verify": cmd_verify,
    "trace": cmd_trace,
    "diff": cmd_diff,
    "history": cmd_history,
    "completion": cmd_completion,
}


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    out, err = sys.stdout, sys.stderr
    from lifecycle.core.errors import LifecycleError

    try:
        return COMMANDS[ns.command](ns, out, err)
    except LifecycleError as exc:
        from lifecycle.core.format.text import clean

        print(f"replay: error: {clean(exc)}", file=err)
        return ReplayExit.BAD_INPUT
    except (RecursionError, OverflowError) as exc:
        # A value past what replay can hold (a number past 64 bits, nesting past the stack)
        # is bad input, never a verdict: exit 1 would read as "failed".
        from lifecycle.core.format.text import clean

        what = "nests too deeply" if isinstance(exc, RecursionError) else "holds too large a number"
        print(f"replay: error: the input {what} to be read ({clean(exc)[:200]})", file=err)
        return ReplayExit.BAD_INPUT
    except BrokenPipeError:
        # `replay ... | head`: the reader left; nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return ReplayExit.OK


if __name__ == "__main__":
    sys.exit(main())
