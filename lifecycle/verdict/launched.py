"""A run as the process that launched its ranks sees it end (the launcher, `serve`): each
rank's exit status and line, and the verdict's culprit first in the line that says why the run
failed, as `replay diagnose` names it (pure)."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lifecycle.core.format.events import Error
from lifecycle.core.format.states import State
from lifecycle.core.format.view import RankView
from lifecycle.core.settings.config import ServerArgs, args_to_json
from lifecycle.verdict.analysis import combine, config_number
from lifecycle.verdict.diagnose import Diagnosis, diagnose
from lifecycle.verdict.headline import Culprit, Wrong, culprit_text, named_culprits


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchedRun:
    """A run as its launcher knows it from its own settings: what the journal's run row says
    of it, without reading that row."""

    run_id: str
    created_at: float
    world_size: int
    config: Mapping[str, Any]  # the settings as journaled with the run (args_to_json)

    @classmethod
    def of(cls, args: ServerArgs, *, run_id: str, created_at: float) -> LaunchedRun:
        """The run `args` launched, as `run_id` created at `created_at`."""
        return cls(
            run_id=run_id,
            created_at=created_at,
            world_size=args.num_ranks,
            config=args_to_json(args),
        )

    def config_number(self, key: str, default: float | None) -> float | None:
        return config_number(self.config, key, default)


def launched_verdict(
    run: LaunchedRun,
    views: Mapping[int, RankView],
    codes: Sequence[int | None],
    *,
    now: float,
    lost: frozenset[int] = frozenset(),
) -> Diagnosis[LaunchedRun]:
    """The verdict `replay diagnose` gives the run, from each rank's folded journal and what
    the launcher sees of its processes: one that ended (exit status `codes[rank]`), or was
    `lost`, is dead; one still running is alive, however long its heartbeat was starved."""
    ended = frozenset(r for r, code in enumerate(codes) if code is not None) | lost
    running = frozenset(r for r, code in enumerate(codes) if code is None) - ended
    # A launcher folds every rank from the start; one with no event yet left no journal.
    journaled = {r: v for r, v in views.items() if v.events}
    return diagnose(combine(run, journaled), now=now, dead_ranks=ended, live_ranks=running)


def exit_text(code: int | None) -> str:
    """A process's exit status as every line and answer shows it: `exit 1`, `killed by
    SIGKILL` (a signal it did not handle), `stopped by SIGTERM (143)` (a rank that journaled
    its stop by that signal leaves with 128 + its number)."""
    if code is None:
        return "running"
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    if code > 128 and (name := _signal_name(code - 128)).startswith("SIG"):
        return f"stopped by {name} ({code})"
    return f"exit {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def ended_unjournaled(view: RankView, code: int | None) -> bool:
    """The rank's process ended (exit status `code`) without journaling an end (a SIGKILL, a
    crash): whatever state its journal last holds, the rank is no longer in it."""
    return code is not None and not view.terminal


def fatal_errors(view: RankView) -> list[Error]:
    """The errors that failed the rank; a dropped message that failed the run key's check
    (`unauthenticated-message`) is journaled as an error too, and fails nothing."""
    return [error for _, _, error in view.errors if error.fatal]


def failure_reason(
    verdict: Diagnosis[Any], views: Mapping[int, RankView], codes: Sequence[int | None]
) -> str | None:
    """Why the run failed: the culprit the verdict names, how and where it went wrong, then
    each other rank whose startup did not end in ready and a clean stop (exit status 0), in
    rank order; None when nothing went wrong."""
    named = [_crashed_how(c, culprit_text(c), codes) for c in named_culprits(verdict)]
    others = _problems(views, codes, besides=frozenset(verdict.culprit_ranks))
    if named and others:
        others[0] = f"then {others[0]}"
    return "; ".join([*named, *others]) or None


def culprit_error(culprit: Culprit, codes: Sequence[int | None]) -> str:
    """What went wrong with the culprit, as a failed request's answer gives a rank's error:
    its own error as journaled, else what the verdict says of it (where it hung, and which
    peers waited for it there; where its process ended, and how)."""
    if culprit.error is not None:
        return f"{culprit.error.error_type}: {culprit.error.message}"
    said = culprit_text(culprit).removeprefix(f"rank {culprit.rank} ")
    waits = [
        f"rank {w.rank} waited for it in {w.op} #{w.group_seq} of {w.group}"
        for w in culprit.waited_on_by
    ]
    if culprit.wrong is Wrong.HUNG and waits:
        return f"{said}: {', '.join(waits)}, which it never entered"
    if culprit.wrong is Wrong.HUNG and (p := culprit.waiting_in) is not None:
        return f"{said}: inside {p.op} #{p.group_seq} of {p.group}, which its peers entered too"
    return _crashed_how(culprit, said, codes)


def _crashed_how(culprit: Culprit, said: str, codes: Sequence[int | None]) -> str:
    """`said` of a crashed culprit, with how its process ended."""
    if culprit.wrong is not Wrong.CRASHED:
        return said
    code = codes[culprit.rank] if culprit.rank < len(codes) else None
    return f"{said}: {exit_text(code)}" if code is not None else f"{said}: its journal ends"


def _problems(
    views: Mapping[int, RankView], codes: Sequence[int | None], *, besides: frozenset[int]
) -> list[str]:
    problems = []
    aborted = []
    for rank, view in sorted(views.items()):
        if rank in besides:
            continue
        code = codes[rank]
        if view.state == State.FAILED and view.aborts and not fatal_errors(view):
            aborted.append(rank)
        elif view.state == State.FAILED:
            problems.append(f"rank {rank} failed in {view.path[-2]}")  # the state before
        elif ended_unjournaled(view, code):
            problems.append(f"rank {rank} ended in {view.state}: {exit_text(code)}")
        elif State.READY.value not in view.path:
            problems.append(f"rank {rank} never got to ready ({exit_text(code)})")
        elif view.state != State.STOPPED or code != 0:
            problems.append(f"rank {rank} did not stop cleanly ({exit_text(code)})")
    if aborted:
        problems.append(f"rank {', '.join(map(str, aborted))} aborted (the agreed abort)")
    return problems


def summary_lines(
    views: Mapping[int, RankView], codes: Sequence[int | None], *, created_at: float
) -> list[str]:
    """One line per rank: its state, when it entered ready, its exit status, its first error
    (of those that failed it)."""
    lines = []
    for rank, view in views.items():
        code = codes[rank]
        fatal = fatal_errors(view)
        state = f"{view.state} (end not journaled)" if ended_unjournaled(view, code) else view.state
        if view.aborts and not fatal:
            failed = view.aborts[0][2].failed_rank
            state = "aborted" if failed is None else f"aborted (rank {failed} failed)"
        ready_at = view.entered_at(State.READY.value)
        ready = f"entered ready after {ready_at - created_at:.2f} s" if ready_at else "never ready"
        error = f"; {fatal[0].error_type}: {fatal[0].message}" if fatal else ""
        lines.append(f"rank {rank}: {state:<12} {ready}; {exit_text(code)}{error}"[:300])
    return lines
