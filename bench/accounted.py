"""Every second of a startup accounted: what no phase holds (`unattributed`) as a share of the
startup to ready, for every built-in model and a model directory, on one rank and four, on a
journal's first boot (which calibrates) and its second (which reuses the verified plan).

Each boot is `lifecycle boot` in a child process; its account is `replay show --json`'s
`startup` object of each rank (`total_s`, `unattributed_s`): a share within one startup, so
the startup itself is its baseline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.bootrun import Booted, boot, clean_env
from bench.stats import median, median_interval
from bench.suite import Benchmark, Settings, progress
from bench.table import Row, at_most, format_seconds, missing_extra

TARGET_SHARE = 0.02
MODEL_PATH = "model-path"  # the case of a diffusers directory, beside the built-in models
BOOT_TIMEOUT_S = {True: 600.0, False: 1200.0}  # by settings.quick
FIRST, SECOND = "first boot", "second boot"


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    model: str  # a built-in's name, or MODEL_PATH
    ranks: int

    @property
    def label(self) -> str:
        return f"{self.model}, {self.ranks} rank{'s' if self.ranks > 1 else ''}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    cases: tuple[Case, ...]
    rounds: int


def builtin_models() -> tuple[str, ...]:
    """The models `lifecycle boot --model` builds without files: the presets and tiny-wan."""
    from lifecycle.adapters.diffusers.wan.tinywan import TINY_WAN
    from lifecycle.core.settings.modelspec import MODEL_PRESETS

    return (*MODEL_PRESETS, TINY_WAN)


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        cases = (Case(model="micro-video", ranks=1), Case(model=MODEL_PATH, ranks=1))
        return Sized(cases=cases, rounds=1)
    models = (*builtin_models(), MODEL_PATH)
    return Sized(cases=tuple(Case(model=m, ranks=r) for m in models for r in (1, 4)), rounds=5)


def _model_args(case: Case, directory: Path | None) -> list[str]:
    from bench.diffusers import MODEL_ARGS

    ranks = ["--num-ranks", str(case.ranks)] if case.ranks > 1 else []
    if case.model == MODEL_PATH:
        assert directory is not None
        # The directory's own default request is WanPipeline's 832x480x81 at 50 steps, whose
        # probe would take most of an hour on two cores: tiny-wan's instead.
        return ["--model-path", str(directory), *MODEL_ARGS, *ranks]
    return ["--model", case.model, *ranks]


def measure(settings: Settings) -> list[Row]:
    sized = _sized(settings)
    needs_diffusers = any(c.model in (MODEL_PATH, "tiny-wan") for c in sized.cases)
    directory = None
    if needs_diffusers:
        try:
            import diffusers  # noqa: F401
        except ImportError:
            sized = Sized(
                cases=tuple(c for c in sized.cases if c.model not in (MODEL_PATH, "tiny-wan")),
                rounds=sized.rounds,
            )
        else:
            from bench.pipelinedirs import save_small_wan

            progress("accounted: writing a small Wan directory with save_pretrained")
            directory = save_small_wan(settings.workdir / "accounted-wan", heads=4)
    env = clean_env()
    boots: dict[tuple[Case, str], list[Booted]] = {}
    for index in range(sized.rounds):
        turn = index % len(sized.cases)
        order = (*sized.cases[turn:], *sized.cases[:turn])  # each case first in turn
        for case in order:
            progress(f"accounted: round {index + 1}/{sized.rounds}, {case.label}")
            # A fresh journal: its first boot calibrates, its second reuses the plan.
            db = settings.workdir / f"accounted-{case.model}-{case.ranks}-{index}.db"
            for which in (FIRST, SECOND):
                booted = boot(
                    _model_args(case, directory), db=db, cwd=settings.workdir, env=env,
                    timeout_s=BOOT_TIMEOUT_S[settings.quick], ranks=case.ranks,
                )  # fmt: skip
                boots.setdefault((case, which), []).append(booted)
    rows = [
        _row(case, which, boots[(case, which)], rounds=sized.rounds)
        for case in sized.cases
        for which in (FIRST, SECOND)
    ]
    if needs_diffusers and directory is None:
        rows.append(
            missing_extra("accounted: tiny-wan and a model directory not run", extra="diffusers")
        )
    return rows


def _path_kind(path: Sequence[str]) -> str:
    return "calibrated" if "probe" in path else "bounded"


def _row(case: Case, which: str, boots: list[Booted], *, rounds: int) -> Row:
    worst = [max(b.ranks, key=lambda r: r.share) for b in boots]
    shares = [r.share for r in worst]
    share = median(shares)
    interval = median_interval(shares)
    kinds = sorted({_path_kind(b.path) for b in boots})
    top = _largest_phases(boots)
    model = "a small Wan directory (--model-path)" if case.model == MODEL_PATH else case.model
    return Row(
        figure=f"accounted: {case.label}, {which} ({'/'.join(kinds)} path)",
        value=format_seconds(median([r.unattributed_s for r in worst])) + " unattributed",
        baseline=format_seconds(median([b.ready_s for b in boots])) + " to ready",
        ratio=f"{share:.2%}",
        target=at_most(share, TARGET_SHARE, spec=".0%"),
        how=(
            f"`lifecycle boot` of {model} on {case.label.split(', ')[-1]}, the {which} on a fresh"
            f" journal; `replay show RUN --json`'s startup of each rank: unattributed_s /"
            f" total_s (the launch to ready), the largest over the ranks (rank"
            f" {_most_often([r.rank for r in worst])} most often), median of {rounds} round(s),"
            f" in [{interval.low:.2%}, {interval.high:.2%}] with {interval.coverage:.1%}"
            f" confidence (sign test); the largest round {max(shares):.2%}; the ratio is that"
            f" share, the baseline the startup to ready (the last rank's, median); the largest"
            f" phases (rank 0, median): {top}"
        ),
    )


def _most_often(values: Sequence[int]) -> int:
    return max(sorted(set(values)), key=values.count)


def _largest_phases(boots: Sequence[Booted], count: int = 3) -> str:
    seconds: dict[str, list[float]] = {}
    for booted in boots:
        for name, value in booted.ranks[0].phases:
            seconds.setdefault(name, []).append(value)
    medians: dict[str, float] = {name: median(values) for name, values in seconds.items()}
    largest = sorted(medians, key=medians.__getitem__, reverse=True)[:count]
    return ", ".join(f"{name} {format_seconds(medians[name])}" for name in largest)


BENCHMARK = Benchmark(name="accounted", measure=measure)
