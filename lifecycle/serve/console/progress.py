"""What `lifecycle boot` and `serve` show of a startup as it runs: the launch, a line per state
left, and how far the current state has got against what history expects of it (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field

from lifecycle.core.decisions.compiling import compiled_text, kept_text
from lifecycle.core.decisions.learnedshapes import chosen_text
from lifecycle.core.decisions.weightskey import weights_text
from lifecycle.core.format.accounting import account, total_text
from lifecycle.core.format.events import (
    ActionFinished,
    AttachRejected,
    BuffersDropped,
    ClockAligned,
    Compiled,
    CompileKept,
    Error,
    Event,
    Expectations,
    FaultInjected,
    LoadFinished,
    LoadStarted,
    PlanBuilt,
    ReferenceOutput,
    ResidencyApplied,
    ResidencyPlanned,
    ResidencyRolledBack,
    ResidencyVerified,
    RunStarted,
    ShapesChosen,
    StoredEvent,
    Transition,
    WarmupRecord,
    WeightsKept,
    WeightsPath,
    WeightsReleased,
)
from lifecycle.core.format.fold import RankFold
from lifecycle.core.format.launchphase import clock_offset
from lifecycle.core.format.phrases import reuse_text, skip_hint
from lifecycle.core.format.records import Role, StateExpectation
from lifecycle.core.format.states import State, happy_trigger, next_state
from lifecycle.core.format.view import RankView
from lifecycle.serve.console.rankstatus import RankStatus
from lifecycle.serve.console.steps import StepMark

MIB = 2**20
STATE_NAMES = frozenset(s.value for s in State)
# Two process starts closer than this (/proc counts in 10 ms ticks) are one process's.
SAME_INSTANT_S = 0.001


def format_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / MIB:.1f} MiB"


# -- the launch and the time left, from a rank's folded view --------------------------------


def states_ahead(state: str, *, calibrating: bool) -> tuple[str, ...]:
    """The states after `state` on the way to ready (ready included), as the table walks them
    on the calibrating or the bounded path."""
    ahead: list[str] = []
    current: State | None = State(state)
    while (
        current is not None
        and (trigger := happy_trigger(current, calibration_open=calibrating)) is not None
    ):
        current = next_state(current, trigger, calibration_open=calibrating)
        if current is None or current.value in ahead:
            break
        ahead.append(current.value)
    return tuple(ahead)


def eta_s(view: RankView, *, now: float) -> float | None:
    """The time a rank is expected to need still before it is ready: what is left of its
    current state's median and the medians of the states after it on its path, from the
    expectations it journaled. None without them, and for a rank that failed or stopped."""
    expected = view.expectations
    if expected is None or not expected.states or view.terminal:
        return None
    if view.healthy:
        return 0.0
    medians = {s.state: s.median_s for s in expected.states}
    calibrating = view.plan.skip_reason is None if view.plan is not None else True
    in_state = view.time_in_state_s(now=now) or 0.0
    left = max(0.0, medians.get(view.state, 0.0) - in_state)
    known = view.state in STATE_NAMES
    ahead = states_ahead(view.state, calibrating=calibrating) if known else ()
    return left + sum(medians.get(state, 0.0) for state in ahead)


# -- the lines, from the events as they come ------------------------------------------------


def calibration_text(event: PlanBuilt) -> str | None:
    """Whether the startup calibrates, and on which probe; None where it names no probe."""
    if event.skip_reason is not None:
        hint = skip_hint(event.skip_reason)
        return f"calibration skipped: {event.skip_reason}" + (f" ({hint})" if hint else "")
    probe = next((r for r in event.requests if r.role is Role.PROBE), None)
    return None if probe is None else f"calibration on: probe {probe.shape}"


def warmup_text(event: WarmupRecord) -> str:
    return (
        f"{event.role} {event.shape} at {event.steps}"
        f" steps {event.total_s:.2f} s, peak {format_bytes(event.peak_bytes)}"
        f" ({event.memory_source or 'unmeasured'})"
    )


def loaded_text(event: LoadFinished, fold: RankFold) -> str:
    """A component's load, as its state's row says it (`fold`: the rank's, for its loads)."""
    # A rate only for what was read from files (a built module's is no read).
    read = any(
        isinstance(e, LoadStarted) and e.component == event.component and e.files
        for _, _, e in fold.loads
    )
    rate = f" ({event.bytes / event.read_s / 1e9:.2f} GB/s)" if read and event.read_s else ""
    failed = "" if event.ok else ", failed"
    return (
        f"loaded {event.component} {format_bytes(event.bytes)} in"
        f" {event.seconds:.2f} s{rate}{failed}"
    )


def detail_text(event: Event, fold: RankFold) -> str | None:
    """What a state did, as its row says after its duration; None for an event no row
    mentions."""
    match event:
        case PlanBuilt():
            return calibration_text(event)
        case Compiled():
            return compiled_text(event)
        case CompileKept():
            return kept_text(event)
        case ShapesChosen():
            return chosen_text(event)
        case WeightsPath() | WeightsKept() | AttachRejected() | WeightsReleased():
            return weights_text(event)
        case ReferenceOutput() if event.outcome != "matched":
            return weights_text(event)
        case ResidencyPlanned():
            plan = event.plan
            verdict = "plan" if plan.fits else "no plan applied"
            return (
                f"{verdict} {plan.plan_id}: peak {format_bytes(plan.predicted_peak_bytes)}"
                f" predicted, budget {format_bytes(plan.budget_bytes)} (not reused:"
                f" {reuse_text(event.reuse)})"
            )
        case ResidencyApplied() if event.reused_from is not None:
            return f"applied {event.plan.plan_id}"
        case ResidencyVerified():
            return (
                f"verified {event.plan.plan_id}: peak {format_bytes(event.measured_bytes)}"
                f" (predicted {format_bytes(event.predicted_bytes)})"
            )
        case ResidencyRolledBack():
            return f"rolled back {event.plan.plan_id}: {event.reason}"
        case LoadFinished():
            return loaded_text(event, fold)
        case BuffersDropped():
            freed = format_bytes(event.bytes_freed)
            return f"dropped {event.buffers} staging buffers, freed {freed}"
        case _:
            return None


@dataclass
class ProgressPrinter:
    """Turns the ranks' events into the lines to show: the launch (rank 0's, once every rank
    has journaled its start), rank 0's states with their durations and what each did, every
    rank's faults, errors and failures, and the startup's ready line once every one of the
    `ranks` is ready (its ready action done), not before: a rank ready while another fails is
    no startup ready. Startup to ready counts from the launch (`run_created_at` where no rank
    says when it was launched)."""

    run_created_at: float
    ranks: int = 1
    _entered: dict[int, tuple[str, float]] = field(default_factory=dict)
    _details: dict[int, list[str]] = field(default_factory=dict)
    _warmup_s: dict[int, float] = field(default_factory=dict)
    _ready_at: dict[int, float] = field(default_factory=dict)  # when each rank entered ready
    _ready_done: set[int] = field(default_factory=set)  # ranks whose ready action finished
    _announced: bool = False
    _started: dict[int, tuple[float, RunStarted]] = field(default_factory=dict)  # its first event
    _offsets: dict[int, float] = field(default_factory=dict)  # each rank's clock less rank 0's
    _launch_shown: bool = False
    _expected: dict[int, dict[str, StateExpectation]] = field(default_factory=dict)
    _folds: dict[int, RankFold] = field(default_factory=dict)  # every rank's, for its account

    def feed(self, stored: StoredEvent) -> list[str]:
        rank = stored.rank
        # A rank's own lines name it whenever there are several, rank 0 like the others; the
        # table's rows are the startup's, on rank 0's clock, and name no rank.
        prefix = f"[rank {rank}] " if self.ranks > 1 else ""
        progress: list[str] = []  # this rank's own progress: shown for rank 0
        out: list[str] = []  # shown for every rank
        event = stored.event
        fold = self._folds.get(rank)
        if fold is None:
            fold = self._folds[rank] = RankFold(run_id=stored.run_id, rank=rank)
        fold.apply(stored)
        details = self._details.setdefault(rank, [])
        if rank not in self._entered:
            self._entered[rank] = (State.CREATED.value, stored.wall_time)
        match event:
            case RunStarted():
                self._started[rank] = (stored.wall_time, event)
                if len(self._started) >= self.ranks:
                    out.extend(self._launch_line())
            case ClockAligned():
                self._offsets[rank] = clock_offset(event)
            case Expectations():
                self._expected[rank] = {s.state: s for s in event.states}
            case Transition():
                if rank == 0 and self._entered[rank][0] == State.CREATED:
                    progress.extend(self._launch_line())  # before created, if not yet shown
                progress.extend(self._leave_state(stored, event))
                if event.dest == State.FAILED:
                    out.append(f"{prefix}  failed")
            case ActionFinished() if stored.state == State.READY and event.ok:
                self._ready_done.add(rank)
                if len(self._ready_done) == self.ranks and not self._announced:
                    self._announced = True
                    out.append(self._ready_line())
                    out.extend(self._accounted_lines())
            case WarmupRecord():
                self._warmup_s[rank] = self._warmup_s.get(rank, 0.0) + event.total_s
                details.append(warmup_text(event))
            case FaultInjected():
                out.append(f"{prefix}  fault injected: {event.fault}")
            case Error() if event.fatal:
                out.append(
                    f"{prefix}  error in {stored.state}: {event.error_type}: {event.message}"
                )
            case _:
                detail = detail_text(event, fold)
                if detail is not None:
                    details.append(detail)
        return [*progress, *out] if rank == 0 else out

    def _leave_state(self, stored: StoredEvent, event: Transition) -> list[str]:
        """The row of the state `stored`'s rank leaves, with what it did, as it enters the
        next."""
        rank = stored.rank
        state, since = self._entered[rank]
        details = self._details[rank]
        rows: list[str] = []
        # Ready is announced once for the startup; a rank that fails there says so.
        if state != State.READY or event.dest == State.FAILED:
            line = f"  {state:<13} {stored.wall_time - since:8.3f} s"
            if details:
                line += "   " + "; ".join(details)
            rows.append(line)
        details.clear()
        self._entered[rank] = (event.dest, stored.wall_time)
        if event.dest == State.READY:
            self._ready_at[rank] = stored.wall_time
        return rows

    def _launch_line(self) -> list[str]:
        """Rank 0's launch: from its launcher's start to its first event (the table's rows
        then add up to the startup); with several ranks, which journaled its start last."""
        created, started = self._started.get(0, (0.0, None))
        launched = started.launcher_started_wall if started is not None else None
        if self._launch_shown or started is None or launched is None:
            return []
        self._launch_shown = True
        words = "process started" if self.ranks == 1 else "processes started"
        parts = []
        spawn_s = (started.process_started_wall or launched) - launched
        if spawn_s > SAME_INSTANT_S:  # a rank the launcher started, not the launcher itself
            parts.append(f"start +{spawn_s:.2f} s")
        if started.phases:
            parts.append(", ".join(f"{p.name} {p.seconds:.2f} s" for p in started.phases))
        elif started.imports_s is not None:
            parts.append(f"imports {started.imports_s:.2f} s")
        # Each rank's launch on its own clock: before the alignment, rank clocks may differ.
        launches = {
            rank: wall - (event.launcher_started_wall or wall)
            for rank, (wall, event) in self._started.items()
        }
        last = max(launches, key=lambda r: (launches[r], -r))
        if last != 0 and len(launches) == self.ranks:
            parts.append(f"rank {last} last, at {launches[last]:.2f} s")
        detail = f" ({'; '.join(parts)})" if parts else ""
        said = words if started.phases else f"{words}, torch imported"
        return [f"  {'launch':<13} {created - launched:8.3f} s   {said}{detail}"]

    def _accounted_lines(self) -> list[str]:
        """The startup accounted: the rank whose phases leave the most unattributed (every
        rank's is in `replay show`), its phases in order after the launch."""
        accounts = [a for fold in self._folds.values() if (a := account(fold.view()))]
        if not accounts:
            return []
        worst = max(accounts, key=lambda a: (a.unattributed_share, -a.rank))
        who = f" (rank {worst.rank}, the least accounted)" if self.ranks > 1 else ""
        return [f"  {'accounted':<13} {total_text(worst)}{who}"]

    def launched_at(self) -> float:
        """The launch on rank 0's clock: the earliest launcher start a rank journaled, else
        `run_created_at`."""
        launches = [
            launched - self._offsets.get(rank, 0.0)
            for rank, (_, event) in self._started.items()
            if (launched := event.launcher_started_wall) is not None
        ]
        return min(launches, default=self.run_created_at)

    def _ready_line(self) -> str:
        """The startup's time to ready (its last rank's) from the launch, and the longest
        warmup of a rank."""
        launched = self.launched_at()
        ready_s = max(self._ready_at.values(), default=launched) - launched
        warm = max(self._warmup_s.values(), default=0.0)
        launch = self._started.get(0)
        lead = (
            f"launch {launch[0] - launch[1].launcher_started_wall:.2f} s, "
            if launch is not None and launch[1].launcher_started_wall is not None
            else ""
        )
        return f"  {'ready':<13} startup to ready {ready_s:.2f} s ({lead}warmup {warm:.2f} s)"

    def status(self, rank: int, mark: StepMark | None) -> RankStatus | None:
        """Where `rank` is, with `mark` (its latest step mark) when it is of its current state;
        None before its first event."""
        entered = self._entered.get(rank)
        if entered is None:
            return None
        state, since = entered
        fold = self._folds.get(rank)
        running = fold.action if fold is not None else None
        return RankStatus(
            rank=rank,
            state=state,
            entered_at=since,
            mark=mark if mark is not None and mark.state == state else None,
            expected=self._expected.get(rank, {}).get(state),
            action=running.action if running is not None else None,
        )
