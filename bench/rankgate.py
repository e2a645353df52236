"""What gate-check's check of the ranks costs: the `check-ranks` action (the environments
gathered and compared, the compute probe, each group's timed all-to-all, the figures gathered)
as a share of the same startup's launch to ready, for every built-in model on one, two and
four ranks (docs/ranks.md, "The gate checks the ranks").

Each boot is `lifecycle boot` in a child process; the action's seconds and the startup are
`replay show --json`'s `startup` of each rank: a share within one startup, so the startup
itself is its baseline.
"""

from __future__ import annotations

from bench.accounted import Case, builtin_models
from bench.bootrun import Booted, boot, clean_env
from bench.stats import median, median_interval
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, at_most, format_seconds

TARGET_SHARE = 0.01
PHASE = "gate-check/check-ranks"
BOOT_TIMEOUT_S = 900.0


def _args(case: Case) -> list[str]:
    """`lifecycle boot`'s arguments for `case`: four ranks as CFG 2 x Ulysses 2."""
    layout = ["--num-ranks", str(case.ranks)] if case.ranks > 1 else []
    if case.ranks == 4:
        layout += ["--cfg-parallel", "2"]
    return ["--model", case.model, *layout]


def _cases(settings: Settings) -> tuple[tuple[Case, ...], int]:
    if settings.quick:
        return (Case(model="micro-video", ranks=2),), 1
    models = [m for m in builtin_models() if m != "tiny-wan" or _has_diffusers()]
    return tuple(Case(model=m, ranks=r) for m in models for r in (1, 2, 4)), 3


def _has_diffusers() -> bool:
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return False
    return True


def measure(settings: Settings) -> list[Row]:
    cases, rounds = _cases(settings)
    env = clean_env()
    boots: dict[Case, list[Booted]] = {}
    for index in range(rounds):
        for case in (*cases[index % len(cases) :], *cases[: index % len(cases)]):
            progress(f"rankgate: round {index + 1}/{rounds}, {case.label}")
            db = settings.workdir / f"rankgate-{case.model}-{case.ranks}-{index}.db"
            booted = boot(
                _args(case), db=db, cwd=settings.workdir, env=env, timeout_s=BOOT_TIMEOUT_S,
                ranks=case.ranks,
            )  # fmt: skip
            boots.setdefault(case, []).append(booted)
    return [_row(case, boots[case], rounds=rounds) for case in cases]


def _gate_s(booted: Booted) -> float:
    """The check's seconds on the rank it took the least on: its first collective is the
    group's first meeting after each rank's load from disk, so every other rank's time holds
    its wait for the last one's load (which the next action waited for before there was a
    check); the last to arrive waits for no one, and its time is the check's own."""
    return min(sum(s for name, s in rank.phases if name == PHASE) for rank in booted.ranks)


def _row(case: Case, boots: list[Booted], *, rounds: int) -> Row:
    shares = [_gate_s(b) / b.ready_s for b in boots]
    share = median(shares)
    interval = median_interval(shares)
    return Row(
        figure=f"gate-check's check of the ranks: {case.label}",
        value=format_seconds(median([_gate_s(b) for b in boots])) + " checking the ranks",
        baseline=format_seconds(median([b.ready_s for b in boots])) + " to ready",
        ratio=f"{share:.2%}",
        target=at_most(share, TARGET_SHARE, spec=".0%"),
        how=(
            f"`lifecycle boot {' '.join(_args(case))}` on a fresh journal (the calibrating"
            f" path); `replay show RUN --json`'s startup phases: the `{PHASE}` action's seconds"
            f" (environments gathered and compared, the compute probe, each group's timed"
            f" all-to-all, the figures gathered) on the rank it took the least on (the last to"
            f" finish loading, which waits for no one: on the others it holds their wait for"
            f" that rank's load), over the startup to ready (the last rank's); median of"
            f" {rounds} round(s), in [{interval.low:.2%}, {interval.high:.2%}] with"
            f" {interval.coverage:.1%} confidence (sign test); the largest round {max(shares):.2%}"
        ),
    )


BENCHMARK = Benchmark(name="rankgate", measure=measure)
