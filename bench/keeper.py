"""The host's keeper of finished weights (`lifecycle keeper`) against loading them from disk:
a startup that attaches to the keeper's copy against one that loads (`--keeper off`), a 2-rank
serve killed and started again, four local ranks' memory of one copy, a wake against a cold
start, and what holding an attached startup to its reference output costs.

Every boot, serve and keeper is a child process (`python -m lifecycle`), each row's keeper one
of its own with a key of the run's own (LIFECYCLE_ARTIFACT_KEY), stopped at the row's end. The
model directories are bench.loadside's (random weights written by WanPipeline.save_pretrained
in a worker process, as bench.parallelload writes them), sized to this machine's memory and
removed after.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.bootrun import clean_env
from bench.keeperprocs import (
    BOOT_OPTIONS,
    DIRECTORY_OPTIONS,
    FOUR_RANKS,
    KEY_VAR,
    MAPPING_NAME,
    MICRO,
    SHAPE,
    STEPS,
    Started,
)
from bench.keepersides import (
    Boots,
    Counts,
    Directory,
    Restarts,
    Shared,
    Woken,
    counted,
    measure_boots,
    measure_restarts,
    measure_shared,
    measure_wakes,
    sizes,
    write_directory,
)
from bench.stats import median, median_interval
from bench.suite import Benchmark, Settings
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most, verdict

ATTACH_TARGET = 0.05  # the attach's seconds / a cold load's
RESTART_TARGET = 0.4  # SGLang PR 40230: 0.35x at one rank
SHARED_TARGET = 1.3  # four ranks' summed Pss of the keeper's copy / one rank's weights
WAKE_TARGET = 0.2
VERIFY_TARGET = 0.02


def measure(settings: Settings) -> list[Row]:
    env = clean_env({KEY_VAR: secrets.token_hex(32)})  # the keeper's and the ranks' key
    try:
        import diffusers  # noqa: F401
    except ImportError:
        missing = True
    else:
        missing = False
    with tempfile.TemporaryDirectory(prefix="keeper-", dir=settings.workdir) as scratch:
        work = Path(scratch)
        directory_rows = None if missing else _directory_rows(settings, work, env)
        shared = measure_shared(settings, work / "shared", env)
        woken = measure_wakes(settings, work / "wake", env)
    if directory_rows is None:
        return [
            missing_extra("keeper: attach against a cold load: not run", extra="diffusers"),
            missing_extra("keeper: restarted 2-rank serve: not run", extra="diffusers"),
            _shared_row(shared),
            _wake_row(woken),
            missing_extra("keeper: the verification's cost: not run", extra="diffusers"),
        ]
    attach, restart, verify, verify_warm = directory_rows
    return [attach, restart, _shared_row(shared), _wake_row(woken), verify, verify_warm]


def _directory_rows(
    settings: Settings, work: Path, env: Mapping[str, str]
) -> tuple[Row, Row, Row, Row]:
    """Rows 1, 2 and the verification's two: each directory written, measured and removed."""
    found: list[Counts] = []

    def counts() -> Counts:
        if not found:
            found.append(counted(sizes(settings).vocab))
        return found[0]

    one = write_directory(settings, work, "wan-boots", copies=2, ranks=1, counts=counts)
    fixed = sizes(settings).transformer_layers is not None  # --quick: one directory for both
    try:
        boots = measure_boots(settings, one, work / "boots", env)
    finally:
        if not fixed:
            shutil.rmtree(one.path, ignore_errors=True)
    # Two ranks that each load and pack a copy while the keeper is filled: four copies.
    two = one if fixed else write_directory(settings, work, "wan-restarts", copies=4, ranks=2,
                                       counts=counts)  # fmt: skip
    try:
        restarts = measure_restarts(settings, two, work / "restarts", env)
    finally:
        shutil.rmtree(two.path, ignore_errors=True)
    return (
        _attach_row(one, boots),
        _restart_row(two, one, restarts),
        _verify_row(boots),
        _verify_warm_row(restarts),
    )


# --- the rows --------------------------------------------------------------------------------


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def _interval(ratios: Sequence[float]) -> str:
    found = median_interval(ratios)
    return (
        f"[{format_ratio(found.low)}, {format_ratio(found.high)}] with {found.coverage:.1%}"
        " confidence (sign test)"
    )


def _seconds_each(values: Sequence[float]) -> str:
    return ", ".join(format_seconds(v) for v in values)


def _weights_s(run: Started) -> float:
    return max(e.seconds for e in run.paths("gate-check"))


def _attach_row(directory: Directory, boots: Boots) -> Row:
    a = [_weights_s(b) for b in boots.attached]
    b = [_weights_s(b) for b in boots.cold]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    nbytes = boots.attached[0].paths("gate-check")[0].bytes
    kept = boots.fill.kept
    give_s = median([e.seconds for e in boots.fill.paths("gate-check")])
    ready_a = [x.ready_s for x in boots.attached]
    ready_b = [x.ready_s for x in boots.cold]
    c = [x["seconds"] for x in boots.alone]
    floor = median([x / y for x, y in zip(c, b, strict=True)])
    ratio = median(ratios)
    target = verdict(f"<= {ATTACH_TARGET:g}", met=ratio <= ATTACH_TARGET)
    return Row(
        figure="keeper: attach against a cold load (Wan-1.3B-sized directory, float32 on CPU)",
        value=format_seconds(median(a)),
        baseline=f"{format_seconds(median(b))} load, --keeper off",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor)}: "
        + ("reachable" if floor <= ATTACH_TARGET else "NOT reachable"),
        how=(
            f"{directory.text()}. `lifecycle boot --model-path DIR {' '.join(BOOT_OPTIONS)}`, one"
            " rank, journal shared by every boot; a keeper of its own (`lifecycle keeper`,"
            " default budget), filled once by a boot that loaded"
            f" ({format_seconds(give_s)}) and gave its weights (weights_kept: {kept[0]}, in"
            f" {format_seconds(boots.fill.kept_s[0])}: the copy into the memfd and the"
            " keeper's answer); then"
            f" {len(a)} round(s), the order of the sides rotating: A `--keeper PATH` (attached,"
            " reference_output matched), B `--keeper off` (loaded), C the floor. Value and"
            " baseline: the"
            " weights_path event's seconds (A: the keeper's answer, the skeleton's signature"
            " checked, unpickled onto the mapped memfd; B: the pipeline built and read from"
            f" the page cache), medians; {_mib(nbytes)} of weights either way; the ratio is the"
            f" median of the paired ratios, in {_interval(ratios)}. Each: A"
            f" {_seconds_each(a)}; B {_seconds_each(b)}. Startup to ready (launch to ready):"
            f" A {format_seconds(median(ready_a))} (its verification included, below), B"
            f" {format_seconds(median(ready_b))}. C, the floor: the same attach alone, by the"
            " boot's own call (weightpath._attach), in a fresh process that imported what a"
            " boot's load imports and collected its garbage before the clock:"
            f" {_seconds_each(c)} (paired ratio to B, median); a full garbage collection of that"
            f" process's {median([x['objects'] for x in boots.alone]):,.0f} objects right after"
            f" took {format_seconds(median([x['collect_s'] for x in boots.alone]))}: A less C is"
            " what the boot's attach pays beyond the unpickling and the keeper's answer (a"
            " collection that the unpickling's allocations set off, in a boot's larger heap)"
        ),
    )


def _restart_row(directory: Directory, first: Directory, restarts: Restarts) -> Row:
    a = [r.ready_s for r in restarts.kept]
    b = [r.ready_s for r in restarts.off]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    # No attach can take less than nothing: B less its load is what a restart keeps paying.
    floor = [(r.ready_s - _weights_s(r)) / r.ready_s for r in restarts.off]
    floor_ratio = median(floor)
    if directory.path == first.path:
        size = "the same directory as above"
    elif directory.layers == first.layers:
        size = "a directory of the same size as above, written again"
    else:
        size = f"a smaller directory written the same way ({directory.text()})"
    ratio = median(ratios)
    target = verdict(f"<= {RESTART_TARGET:g}", met=ratio <= RESTART_TARGET)
    warm_a = [r.action("bounded-warm", "bounded-warmup") for r in restarts.kept]
    warm_b = [r.action("bounded-warm", "bounded-warmup") for r in restarts.off]
    load_b = [_weights_s(r) for r in restarts.off]
    attach_a = [_weights_s(r) for r in restarts.kept]
    return Row(
        figure="keeper: restarted 2-rank serve, startup to ready",
        value=format_seconds(median(a)),
        baseline=f"{format_seconds(median(b))} --keeper off",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor_ratio)}: "
        + ("reachable" if floor_ratio <= RESTART_TARGET else "NOT reachable"),
        how=(
            f"`lifecycle serve --model-path DIR {' '.join(DIRECTORY_OPTIONS)} --num-ranks 2`"
            f" (ulysses 2, the default bounded warmup), {size}; a keeper of its own, filled by a"
            " first serve (weights_kept: "
            + ", ".join(
                f"{o} in {format_seconds(t)}"
                for o, t in zip(restarts.fill.kept, restarts.fill.kept_s, strict=True)
            )
            + ": one rank's copy kept, the other's held already, each packed first),"
            " SIGKILLed with its process group; then"
            f" {len(a)} pair(s) of restarts alternated, each started after the SIGKILL of the"
            " serve before it: A `--keeper PATH` (every rank attached), B `--keeper off`"
            " (every rank loaded). Startup to ready: the run's creation (the serve's launch)"
            " to the last rank entering ready, from the journal, medians; paired ratio in"
            f" {_interval(ratios)}; each: A {_seconds_each(a)}, B {_seconds_each(b)}. Weights:"
            f" A attached in {format_seconds(median(attach_a))}, B loaded in"
            f" {format_seconds(median(load_b))}; the bounded warmup's request, A on attached"
            f" weights {format_seconds(median(warm_a))}, B on loaded ones"
            f" {format_seconds(median(warm_b))}. Floor: B less its load, over B (what a"
            " restart that took no time for its weights would still pay: the launch and"
            " imports, the warmup), median of the restarts"
        ),
    )


def _verify_row(boots: Boots) -> Row:
    verify = [b.action("bounded-warm", "verify-weights") for b in boots.attached]
    ready = [b.ready_s for b in boots.cold]
    ratios = [x / y for x, y in zip(verify, ready, strict=True)]
    request = [b.requests.get(("bounded-warm", "verify"), 0.0) for b in boots.attached]
    floor = median([x / y for x, y in zip(request, ready, strict=True)])
    ratio = median(ratios)
    target = verdict(f"<= {VERIFY_TARGET:.0%}", met=ratio <= VERIFY_TARGET)
    return Row(
        figure="keeper: the verification's cost, attached boot without warmup",
        value=format_seconds(median(verify)),
        baseline=f"{format_seconds(median(ready))} cold startup to ready",
        ratio=f"{ratio:.1%}",
        target=f"{target}; floor {floor:.1%}: "
        + ("reachable" if floor <= VERIFY_TARGET else "NOT reachable"),
        how=(
            "the boots of the attach row (`--warmup-mode none`): the verify-weights action's"
            " duration_s (action_finished, state bounded-warm) in each attached boot, over the"
            " startup to ready of the cold boot (`--keeper off`) of its pair, which verifies"
            " nothing (no keeper, no warmup); median of the paired ratios, in"
            f" {_interval(ratios)}. With no warmup to reuse, the verification runs the fixed"
            f" request itself ({SHAPE} at {STEPS} step, prompt and negative prompt through the"
            " UMT5-wide encoder, the VAE's decode): that request's request_finished total_s,"
            f" {format_seconds(median(request))}, is the floor no verification that runs it can"
            " go under; reference_output of each attached boot: "
            + ", ".join(sorted({o for b in boots.attached for o in b.references}))
        ),
    )


def _verify_warm_row(restarts: Restarts) -> Row:
    verify = [r.action("bounded-warm", "verify-weights", least=True) for r in restarts.kept]
    waited = [r.action("bounded-warm", "verify-weights") for r in restarts.kept]
    off = [r.action("bounded-warm", "verify-weights", least=True) for r in restarts.off]
    ready = [r.ready_s for r in restarts.off]
    ratios = [x / y for x, y in zip(verify, ready, strict=True)]
    ratio = median(ratios)
    return Row(
        figure="keeper: the verification's cost, attached 2-rank serve after its warmup",
        value=format_seconds(median(verify)),
        baseline=f"{format_seconds(median(ready))} --keeper off restart to ready",
        ratio=f"{ratio:.2%}",
        target=verdict(f"<= {VERIFY_TARGET:.0%}", met=ratio <= VERIFY_TARGET),
        how=(
            "the restarts of the 2-rank serve row (the default bounded warmup, whose request is"
            " the fixed one): the verify-weights action's duration_s in each attached restart"
            " (the warmup's output held to the reference, the ranks agreeing by two all_reduces;"
            " no request of its own), the fastest rank's: the other's includes waiting there"
            f" for the slower warmup ({format_seconds(median(waited))}, median), over the startup"
            " to ready of the --keeper off restart of its pair; median of the paired ratios, in"
            f" {_interval(ratios)}; reference_output: "
            + ", ".join(sorted({o for r in restarts.kept for o in r.references}))
            + "; the --keeper off restarts hold their warmup's output to the reference too"
            f" (verify-weights {format_seconds(median(off))}, fastest rank)"
        ),
    )


def _shared_row(shared: Shared) -> Row:
    summed = shared.summed("pss")
    one = shared.runs[0].paths("gate-check")[0].bytes
    ratio = median(summed) / one
    last = shared.mapped[-1]
    once = median(
        [sum(m.pss for m in run) / max(1, *(m.rss for m in run)) for run in shared.mapped]
    )
    return Row(
        figure="keeper: 4 local ranks hold the weights once",
        value=f"{_mib(median(summed))} summed Pss",
        baseline=f"{_mib(4 * one)} in 4 private copies (4 x {_mib(one)})",
        **ratio_at_most(ratio, SHARED_TARGET, spec="g"),
        how=(
            f"`lifecycle serve {' '.join(MICRO)} {' '.join(FOUR_RANKS)} --keeper PATH`, a"
            " keeper of its own filled by a first serve (weights_kept: "
            + ", ".join(sorted(shared.fill.kept))
            + ": one rank's copy kept, the others held already and served with their own),"
            f" SIGKILLed with its group; then {len(summed)} restart(s), every rank attached; at"
            " /health 200, each rank process's (pids from run_started) Pss of its mappings of"
            f" the keeper's memfd (/proc/PID/smaps, mappings named {MAPPING_NAME}), summed over"
            " the 4 ranks, median over the restarts; the ratio is that over one rank's weights"
            " (its weights_path bytes). Pss counts only the pages a rank has touched by ready:"
            " per rank Pss "
            + ", ".join(_mib(m.pss) for m in last)
            + ", Rss "
            + ", ".join(_mib(m.rss) for m in last)
            + f" of the {_mib(one)} each maps (the rest, never read before ready, is resident in"
            " the memfd alone); pages copied on write in those mappings (Anonymous), summed:"
            f" {_mib(median(shared.summed('anonymous')))}; summed Pss over the most any rank"
            f" has resident (1: every page touched held once; 4: a copy each):"
            f" {format_ratio(once)}; the keeper holds"
            f" {_mib(shared.held_bytes)} (skeleton and blob, all written when given, in shared"
            " memory whether mapped or not): what the host spends on these 4 ranks' weights is"
            " that and the pages copied on write. Baseline: not measured, what 4 ranks with"
            " --keeper off hold in private copies, 4 x the weights_path bytes (a rank's"
            " anonymous memory does not tell its weights from the rest)"
        ),
    )


def _wake_row(woken: Sequence[Woken]) -> Row:
    wake = [w.woke_s for w in woken]
    ready = [w.run.ready_s for w in woken]
    ratios = [x / y for x, y in zip(wake, ready, strict=True)]
    request = [w.run.requests.get(("waking", "verify"), 0.0) for w in woken]
    floor = median([x / y for x, y in zip(request, ready, strict=True)])
    ratio = median(ratios)
    action = [w.run.action("waking", "wake-weights") for w in woken]
    attach = [max(e.seconds for e in w.run.paths("waking")) for w in woken]
    target = verdict(f"<= {WAKE_TARGET:g}", met=ratio <= WAKE_TARGET)
    return Row(
        figure="keeper: wake to ready against a cold start",
        value=format_seconds(median(wake)),
        baseline=f"{format_seconds(median(ready))} cold startup to ready",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor)}: "
        + ("reachable" if floor <= WAKE_TARGET else "NOT reachable"),
        how=(
            f"`lifecycle serve {' '.join(MICRO)} --keeper PATH`, one rank, a fresh keeper each"
            " round so that its startup loads from disk (and gives); the journal holds a"
            " verified residency plan from an earlier boot, so the startup takes the bounded"
            " path as a restart does. At ready, POST /sleep"
            f" ({format_seconds(median([w.slept_s for w in woken]))}), then POST /wake: value"
            " its answer's seconds; baseline the same run's startup to ready (launch to ready,"
            f" from the journal); {len(wake)} round(s), median of the paired ratios. The wake:"
            f" weights attached in {format_seconds(median(attach))}, the wake-weights action"
            f" {format_seconds(median(action))}, of which the fixed request run to verify them"
            f" {format_seconds(median(request))}: the floor, a wake verifies whatever it"
            " attached by running that request"
        ),
    )


BENCHMARK = Benchmark(name="keeper", measure=measure)
