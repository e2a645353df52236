"""Replay at journal scale: diagnose and runs read summaries, so their time stays flat."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

from bench.compare import compared_seconds
from bench.replay import RANKS, Timed, journal_of, timed
from bench.stats import median
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, verdict

DIAGNOSE_TARGET_S = 2.0
GROWTH_TARGET = 2.0  # the large journal's diagnose time over the small one's
RUNS_TARGET_S = 1.0
COLD_START_TARGET_S = 0.5
BOOT_TIMEOUT_S = 180.0
RUNS_RUN_PREFIX = "bench-runs-"
IMPORTS = "import replay.cli, replay.load, replay.views.runs"

# The diagnosis as `replay diagnose` made it before summaries: every event of every rank
# folded (replay.verdict.analysis.analyze), then judged. It reports its VmHWM as bench.replay does.
_FULL_FOLD = """
import re, sys, time
from replay.verdict.analysis import analyze
from replay.verdict.diagnose import diagnose
from replay.verdict.liveness import dead_ranks
from replay.load import Journals
try:
    with Journals.open(sys.argv[1:]) as journals:
        run = journals.resolve("latest")
        analysis = analyze(run, journals.events(run))
        diagnose(analysis, now=time.time(), dead_ranks=dead_ranks(analysis))
finally:
    status_text = open("/proc/self/status").read()
    print("vmhwm", int(re.search(r"VmHWM:\\s+(\\d+)", status_text).group(1)) * 1024,
          file=sys.stderr)
"""


def _mib(value: float) -> str:
    return f"{value / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------
# replay diagnose: a small and a large journal, and the full fold of the large one


def diagnose_rows(settings: Settings) -> list[Row]:
    small, large = (10_000, 30_000) if settings.quick else (10_000, 1_000_000)
    rounds = 1 if settings.quick else 5
    journals = {size: journal_of(settings, size) for size in (small, large)}
    cwd = settings.workdir
    times: dict[int, list[Timed]] = {small: [], large: []}
    for index in range(rounds):  # sizes interleaved, the order flipped every round
        for size in (small, large) if index % 2 == 0 else (large, small):
            argv = ["diagnose", "latest", str(journals[size]), "--json"]
            times[size].append(timed(argv, cwd=cwd))
    # The full fold is slow enough (tens of seconds at 10^6) that one run of it shows the
    # speed-up; it runs after the rounds so that it does not sit between them.
    progress(f"scale: the full fold of {large:,} events, once")
    fold = timed([str(journals[large])], cwd=cwd, script=_FULL_FOLD)
    seconds = {size: median([t.seconds for t in times[size]]) for size in times}
    rss = {size: median([t.peak_rss_bytes for t in times[size]]) for size in times}
    how = (
        f"`replay diagnose latest J --json` in a child process (cold, as an operator runs it)"
        f" on the synthetic {RANKS}-rank journals of bench.replay (CFG 2 x Ulysses 32, written"
        f" through RankWriter, so with summaries; a healthy serving run that reached ready);"
        f" median of {rounds}, sizes interleaved; peak RSS is the child's VmHWM"
    )
    growth = seconds[large] / seconds[small]
    return [
        compared_seconds(
            figure=f"replay diagnose, {large:,} events ({RANKS} ranks)",
            value_s=seconds[large],
            baseline_s=fold.seconds,
            value_note=f", peak {_mib(rss[large])}",
            baseline_note=f" full fold, peak {_mib(fold.peak_rss_bytes)}",
            target=verdict(f"< {DIAGNOSE_TARGET_S:g} s", met=seconds[large] < DIAGNOSE_TARGET_S),
            how=f"{how}. Baseline: the same journal's every event folded by"
            f" replay.verdict.analysis.analyze over Journals.events, then diagnose(), in a child"
            f" process, one run (the verdict as made before summaries)",
        ),
        compared_seconds(
            figure=f"replay diagnose, {small:,} -> {large:,} events ({RANKS} ranks)",
            value_s=seconds[large],
            baseline_s=seconds[small],
            value_note=f" at {large:,}",
            baseline_note=f" at {small:,}",
            target=verdict(
                f"<= {GROWTH_TARGET:g}x (flat in journal size)", met=growth <= GROWTH_TARGET
            ),
            how=f"{how}; memory {format_ratio(rss[large] / rss[small])}x"
            f" ({_mib(rss[small])} -> {_mib(rss[large])})",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# replay runs: one journal of many real startups


def _boot(settings: Settings, db: Path, *extra: str) -> None:
    command = [sys.executable, "-m", "lifecycle", "boot", "--model", "micro-video",
               "--db", str(db), "--log-level", "error", *extra]  # fmt: skip
    try:
        done = subprocess.run(
            command, cwd=settings.workdir, capture_output=True, text=True,
            timeout=BOOT_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise BenchError(f"`{' '.join(command[1:])}` did not finish in time") from None
    if done.returncode != 0:
        tail = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise BenchError(f"`{' '.join(command[1:])}` exited {done.returncode}: {tail[0]}")


def build_runs_journal(path: Path, *, templates: Path, runs: int) -> int:
    """`runs` runs in one journal, copies of the real one-rank startups in `templates` taken
    in turn, ten minutes apart and all ended before now; each written as lifecycle writes it
    (RankWriter, one batch a run), so with its summary row. Returns the events written."""
    from lifecycle.core.format.events import Event
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(str(templates)) as source:
        startups = [(run, list(source.read(run_id=run.run_id))) for run in source.runs()]
    first = time.time() - (runs + 1) * 600.0
    written = 0
    with Journal.open_for_write(str(path)) as journal:
        for index in range(runs):
            run, stored = startups[index % len(startups)]
            run_id = f"{RUNS_RUN_PREFIX}{index:06d}"
            created_at = first + index * 600.0
            shift = created_at - run.created_at
            journal.create_run(dataclasses.replace(run, run_id=run_id, created_at=created_at))
            writer = journal.writer(run_id=run_id, rank=0)
            batch: list[tuple[Event, str, float, int]] = [
                (e.event, e.state, e.wall_time + shift, e.mono_ns) for e in stored
            ]
            writer.append_batch(batch)
            writer.close()
            written += len(batch)
    return written


def runs_rows(settings: Settings) -> list[Row]:
    runs = 1_000 if settings.quick else 10_000
    rounds = 1 if settings.quick else 5
    templates = settings.workdir / "runs-templates.db"
    progress("scale: two real startups (calibrated, then bounded on its verified plan) to copy")
    _boot(settings, templates)
    _boot(settings, templates)
    one = settings.workdir / "runs-1.db"
    many = settings.workdir / f"runs-{runs}.db"
    build_runs_journal(one, templates=templates, runs=1)
    progress(f"scale: writing a journal of {runs:,} runs")
    started = time.perf_counter()
    events = build_runs_journal(many, templates=templates, runs=runs)
    progress(f"scale: wrote it in {time.perf_counter() - started:.1f} s")
    times: dict[Path, list[Timed]] = {one: [], many: []}
    imports: list[float] = []  # the fixed cost's floor: starting Python and importing replay
    for index in range(rounds):
        for path in (one, many) if index % 2 == 0 else (many, one):
            times[path].append(timed(["runs", str(path)], cwd=settings.workdir))
        imports.append(_wall([sys.executable, "-c", IMPORTS], cwd=settings.workdir))
    value = median([t.seconds for t in times[many]])
    baseline = median([t.seconds for t in times[one]])
    per_run = (value - baseline) / (runs - 1)
    peak = median([t.peak_rss_bytes for t in times[many]])
    imported = median(imports)
    how = (
        f"`replay runs J` in a child process on one journal of {runs:,} runs ({events:,} events,"
        f" {events / runs:.0f} a run: copies of a real bounded and a real calibrated one-rank"
        f" `lifecycle boot --model micro-video`, taken in turn, written through RankWriter so"
        f" with summaries); against the same command on a journal of 1 run; median of"
        f" {rounds}, interleaved"
    )
    return [
        compared_seconds(
            figure=f"replay runs, {runs:,} runs in one journal",
            value_s=value,
            baseline_s=baseline,
            value_note=f", peak {_mib(peak)}",
            baseline_note=" for 1 run",
            target=verdict(f"< {RUNS_TARGET_S:g} s", met=value < RUNS_TARGET_S),
            how=f"{how}; the floor: 1 run costs {format_seconds(baseline)}, of which"
            f" {format_seconds(imported)} is starting Python and importing what `replay runs`"
            f" imports (`python -c '{IMPORTS}'`, SQLAlchemy the most of it), which leaves"
            f" {format_seconds(max(0.0, RUNS_TARGET_S - baseline))} of the target for"
            f" {runs:,} runs at {format_seconds(per_run)} each",
        ),
        Row(
            figure=f"replay runs, time per run ({runs:,} runs)",
            value=f"{format_seconds(per_run)}/run",
            baseline=f"{format_seconds(baseline)} for 1 run",
            target=f"no target of its own; < {RUNS_TARGET_S:g} s for 10,000 runs is"
            f" {format_seconds(RUNS_TARGET_S / 10_000)}/run beyond the fixed cost",
            how=f"(time for {runs:,} runs - time for 1 run) / {runs - 1:,}; {how}",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# replay --help: a cold start, and no torch


def _wall(argv: list[str], *, cwd: Path) -> float:
    started = time.perf_counter()
    subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, timeout=60, check=True)
    return time.perf_counter() - started


def _torch_modules(argv: list[str], *, cwd: Path) -> int:
    """How many modules named torch or torch.* `python -X importtime ARGV` imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", *argv], cwd=cwd, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, timeout=60, check=False,
    )  # fmt: skip
    names = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()]
    return sum(1 for name in names if name == "torch" or name.startswith("torch."))


def cold_start_row(settings: Settings) -> Row:
    pairs = 5 if settings.quick else 15
    cwd = settings.workdir
    help_s, bare_s = [], []
    for _ in range(pairs):
        bare_s.append(_wall([sys.executable, "-c", "pass"], cwd=cwd))
        help_s.append(_wall([sys.executable, "-m", "replay", "--help"], cwd=cwd))
    on_help = _torch_modules(["-m", "replay", "--help"], cwd=cwd)
    # What the commands of a verdict import, besides --help's parser.
    on_verdict = _torch_modules(
        ["-c", "import replay.cli, replay.load, replay.verdict.diagnose, replay.verdict.analysis"],
        cwd=cwd,
    )
    value = median(help_s)
    baseline = median(bare_s)
    return compared_seconds(
        figure="replay --help cold start",
        value_s=value,
        baseline_s=baseline,
        baseline_note=" (python -c pass)",
        target=verdict(
            f"< {COLD_START_TARGET_S} s, no torch import",
            met=value < COLD_START_TARGET_S and on_help == 0 and on_verdict == 0,
        ),
        how=f"`python -m replay --help` against `python -c pass`, median of {pairs}"
        f" interleaved pairs of child processes; torch modules in `python -X importtime -m"
        f" replay --help`: {on_help}; in replay.cli, load, diagnose and analysis: {on_verdict}",
    )


def measure(settings: Settings) -> list[Row]:
    return [*diagnose_rows(settings), *runs_rows(settings), cold_start_row(settings)]


BENCHMARK = Benchmark(name="scale", measure=measure)
