"""gate-check's check of the ranks themselves (docs/ranks.md, "The gate checks the ranks"):
what each rank runs on, compared across the group; a short compute probe on each rank's
device and a fixed-size all-to-all in each of its parallel groups, compared against the
group's median; and, on NCCL when asked, NCCL's own diagnostics of the gate's communicators.
Every rank gathers every rank's figures and reaches the same verdict from them."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import structlog
import torch

from lifecycle.core.decisions.rankcheck import (
    TEST_ENVIRONMENT_ENV,
    Partners,
    ProbeFigures,
    SlowFinding,
    as_told,
    best_of,
    cross_host_partners,
    describe_difference,
    describe_slow,
    environment_differences,
    environment_failure,
    slow_findings,
    unusable_figure,
)
from lifecycle.core.errors import RankCheckFailed
from lifecycle.core.format.events import EnvironmentChecked, RankProbed, SlowRank
from lifecycle.core.format.kinds.rankevents import LinkFigure, RankEnvironment
from lifecycle.core.settings.config import ServerArgs, SlowRankPolicy
from lifecycle.runtime.device import synchronize
from lifecycle.runtime.group.comm import Comm, RecordedGroup
from lifecycle.runtime.group.crosshost import (
    LINK_ELEMENTS_PER_PEER,
    LINK_REPEATS,
    crossing_figure,
    probe_cross_host,
)
from lifecycle.runtime.keeping.skeleton import weights_dtypes
from lifecycle.runtime.recorder import Recorder

log = structlog.get_logger("lifecycle.runtime")

# Each rank's environment travels as JSON in a buffer of this many bytes (each value cut to
# VALUE_CHARS first).
ENVIRONMENT_BYTES = 4096
VALUE_CHARS = 200
# The compute probe: a chain of square matmuls of this side, timed this many times (the best
# counts). On CUDA (bfloat16) a chain of 64 at 4096 is some 8.8 TFLOP, tens of milliseconds on
# a data-centre GPU, long past its launch and timer noise; on CPU (float32, one core) one
# matmul at 256, under a millisecond, so that the whole check stays under 1 % of a small
# model's startup to ready (BENCHMARKS.md, rankgate).
PROBE_SIDE = {"cpu": 256, "cuda": 4096}
PROBE_CHAIN = {"cpu": 1, "cuda": 64}
PROBE_REPEATS = {"cpu": 10, "cuda": 10}
# ... at least this many, and no more once this long has passed.
MIN_REPEATS = 3
PROBE_BUDGET_S = 0.05
# A round that finds a rank slow is followed by another, every rank's best figure of the two
# kept (rankcheck.best_of): a host's other work that stalls one round seldom stalls the next.
PROBE_ROUNDS = 2
# The link probe: each member sends LINK_ELEMENTS_PER_PEER float32 to each peer, timed
# LINK_REPEATS times after one that lines the members up (the best counts), as the exchange
# across hosts does (runtime.group.crosshost).
# NCCL's own diagnostics (NCCL 2.31+), and how much of their report is journaled.
NCCL_DIAGNOSTICS = {"NCCL_RUN_DIAGNOSTICS": "1", "NCCL_RUN_RAS_DIAGNOSTICS": "1"}
DIAGNOSTICS_CHARS = 4000


def check_ranks(
    *,
    args: ServerArgs,
    comm: Comm,
    recorder: Recorder,
    device: torch.device,
    pipeline: object,
    stretch: Callable[[float], float],
    env: Mapping[str, str] = os.environ,
) -> None:
    """Compare the ranks' environments, then probe and compare their speed; RankCheckFailed
    (the same line on every rank) when a difference matters, a figure is unusable, or a rank
    is slow under --on-slow-rank fail. `stretch(since)` is a slowed rank's fault (a no-op
    otherwise)."""
    rank = recorder.rank
    mine = local_environment(device, pipeline, rank=rank, env=env)
    everyone = _gather_environments(comm, mine)
    differences = environment_differences(everyone)
    recorder.record(EnvironmentChecked(environment=mine, differences=differences))
    failure = environment_failure(differences)
    if failure is not None:
        culprits = tuple(sorted({r for d in differences if d.matters for r in d.ranks}))
        raise RankCheckFailed(failure, culprits=culprits)
    if rank == 0:
        for difference in differences:
            log.warning("environment_differs", detail=describe_difference(difference))
    partners = cross_host_partners(everyone)
    figures, flop = _probe_round(comm, device, stretch, partners, rank=rank)
    findings = slow_findings(figures, threshold=args.slow_rank_threshold)
    for _ in range(PROBE_ROUNDS - 1):  # every rank decides alike: the figures are gathered
        if not findings or unusable_figure(figures) is not None:
            break
        again, _ = _probe_round(comm, device, stretch, partners, rank=rank)
        figures = best_of(figures, again)
        findings = slow_findings(figures, threshold=args.slow_rank_threshold)
    ours = figures[rank]
    recorder.record(
        RankProbed(
            host=mine.host,
            device=mine.device,
            compute_s=_journaled(ours.compute_s),
            compute_flop=flop,
            links=tuple(
                LinkFigure(
                    group=group.name, seconds=_journaled(ours.links[group.name]), bytes=nbytes
                )
                for group, nbytes in _link_groups(comm)
            )
            + crossing_figure(partners.get(rank), ours.cross_host_s),
            diagnostics=nccl_report(args, env) if device.type == "cuda" else None,
        )
    )
    unusable = unusable_figure(figures)
    if unusable is not None:
        rank_named = unusable.rank
        raise RankCheckFailed(f"the gate's probes: {unusable.line}", culprits=(rank_named,))
    _judge(args, recorder, findings)


def _probe_round(
    comm: Comm,
    device: torch.device,
    stretch: Callable[[float], float],
    partners: Mapping[int, Partners],
    *,
    rank: int,
) -> tuple[list[ProbeFigures], int]:
    """One round of the probes (compute, each group's link, the exchange across hosts) and
    every rank's figures of it; with the compute probe's floating point operations."""
    compute_s, flop = _probe_compute(device, stretch)
    links = _probe_links(comm)
    crossing = probe_cross_host(comm, partners[rank]) if partners else None
    return _gather_figures(comm, compute_s, links, crossing=crossing, partners=partners), flop


def _journaled(seconds: float) -> float:
    """A figure as the journal holds it: one that is not a number (a device that errored) is
    -1, which the check refuses as it does any figure not above zero."""
    return seconds if math.isfinite(seconds) else -1.0


def _judge(args: ServerArgs, recorder: Recorder, findings: tuple[SlowFinding, ...]) -> None:
    """Journal this rank's slow findings, warn of every one (rank 0), or fail on them."""
    threshold, policy = args.slow_rank_threshold, args.on_slow_rank
    for finding in findings:
        if finding.rank == recorder.rank:
            recorder.record(
                SlowRank(
                    measure=finding.measure,
                    group=finding.group,
                    figure_s=finding.figure_s,
                    median_s=finding.median_s,
                    ratio=finding.ratio,
                    threshold=threshold,
                    action=policy.value,
                )
            )
    if not findings:
        return
    said = "; ".join(describe_slow(f, threshold=threshold) for f in findings)
    if policy is SlowRankPolicy.FAIL:
        culprits = tuple(sorted({f.rank for f in findings}))
        raise RankCheckFailed(f"slow rank (--on-slow-rank fail): {said}", culprits=culprits)
    if recorder.rank == 0:
        log.warning("slow_rank", detail=said)


def local_environment(
    device: torch.device, pipeline: object, *, rank: int, env: Mapping[str, str]
) -> RankEnvironment:
    """What this rank runs on; the test hook's values in place of its own where it names
    this rank."""
    cuda = device.type == "cuda"
    found = RankEnvironment(
        host=socket.gethostname(),
        torch=torch.__version__,
        cuda=torch.version.cuda or "",
        nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else "",  # type: ignore[no-untyped-call]
        driver=_nvidia_driver() if cuda else "",
        python=platform.python_version(),
        device=torch.cuda.get_device_name(device) if cuda else _cpu_name(),
        capability=(
            "{}.{}".format(*torch.cuda.get_device_capability(device))
            if cuda
            else torch.backends.cpu.get_cpu_capability()
        ),
        memory_bytes=(
            torch.cuda.get_device_properties(device).total_memory
            if cuda
            else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        ),
        dtype=weights_dtypes(pipeline),
    )
    return as_told(found, rank=rank, text=env.get(TEST_ENVIRONMENT_ENV, ""))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvidia_driver() -> str:
    try:
        text = Path("/proc/driver/nvidia/version").read_text(errors="replace")
    except OSError:
        return ""
    found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", text)
    return found.group(1) if found else ""


def _gather_environments(comm: Comm, mine: RankEnvironment) -> list[RankEnvironment]:
    """Every rank's environment, in rank order, through one all-gather of fixed-size buffers."""
    plain = {k: v[:VALUE_CHARS] if isinstance(v, str) else v for k, v in asdict(mine).items()}
    data = json.dumps(plain).encode()[:ENVIRONMENT_BYTES]
    local = torch.zeros(ENVIRONMENT_BYTES, dtype=torch.uint8)
    local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = comm.world
    # Every row starts as this rank's own, should the gather not run (a skip-collective fault).
    everyone = local.repeat(world.size, 1)
    world.all_gather(everyone, local, purpose="environment-agree")
    return [
        RankEnvironment(**json.loads(bytes(row.tolist()).rstrip(b"\0").decode()))
        for row in everyone
    ]


def _probe_compute(device: torch.device, stretch: Callable[[float], float]) -> tuple[float, int]:
    """The best time of the device class's fixed matmul, and its floating point operations.
    On CPU on one thread: every rank's figure is one core's, whatever its share of the host's
    cores, and a loaded host's thread pool does not stretch it."""
    if device.type == "cuda":
        return _timed_matmul(device, stretch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _timed_matmul(device, stretch)
    finally:
        torch.set_num_threads(threads)


def _timed_matmul(device: torch.device, stretch: Callable[[float], float]) -> tuple[float, int]:
    kind = "cuda" if device.type == "cuda" else "cpu"
    side, chain, repeats = PROBE_SIDE[kind], PROBE_CHAIN[kind], PROBE_REPEATS[kind]
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(0)
    a = torch.randn((side, side), generator=generator).to(device=device, dtype=dtype)
    b = torch.randn((side, side), generator=generator).to(device=device, dtype=dtype)
    torch.mm(a, b)  # the first run pays the kernels' selection
    synchronize(device)
    best = float("inf")
    began = time.perf_counter()
    for done in range(repeats):
        if done >= MIN_REPEATS and time.perf_counter() - began > PROBE_BUDGET_S:
            break  # a loaded host: the best of those so far
        started = time.perf_counter()
        for _ in range(chain):
            torch.mm(a, b)
        synchronize(device)
        stretch(started)
        best = min(best, time.perf_counter() - started)
    return best, 2 * side**3 * chain


def _link_groups(comm: Comm) -> list[tuple[RecordedGroup, int]]:
    """This rank's parallel groups of more than one rank, with the bytes each member sends."""
    return [
        (group, 4 * LINK_ELEMENTS_PER_PEER * (group.size - 1))
        for group in (comm.ulysses, comm.cfg)
        if group.size > 1
    ]


def _probe_links(comm: Comm) -> dict[str, float]:
    """Each parallel group's fixed all-to-all: one that lines the members up, then the best
    of LINK_REPEATS."""
    found: dict[str, float] = {}
    for group, _ in _link_groups(comm):
        elements = group.size * LINK_ELEMENTS_PER_PEER
        out = torch.empty(elements, dtype=torch.float32, device=comm.device)
        inp = torch.ones_like(out)
        group.all_to_all(out, inp, purpose="link-probe")
        best = float("inf")
        for _ in range(LINK_REPEATS):
            started = time.perf_counter()
            group.all_to_all(out, inp, purpose="link-probe")
            synchronize(comm.device)
            best = min(best, time.perf_counter() - started)
        found[group.name] = best
    return found


def _gather_figures(
    comm: Comm,
    compute_s: float,
    links: dict[str, float],
    *,
    crossing: float | None,
    partners: Mapping[int, Partners],
) -> list[ProbeFigures]:
    """Every rank's figures: compute, then its Ulysses and CFG groups' and its exchange across
    hosts (NaN: none)."""
    layout = comm.layout
    nan = float("nan")
    mine = torch.tensor(
        [
            compute_s,
            links.get(comm.ulysses.name, nan),
            links.get(comm.cfg.name, nan),
            nan if crossing is None else crossing,
        ],
        dtype=torch.float64,
    )
    world = comm.world
    everyone = mine.repeat(world.size, 1)  # as the environments' rows
    world.all_gather(everyone, mine, purpose="probe-figures")
    figures = []
    for rank, (compute, ulysses, cfg, across) in enumerate(everyone.tolist()):
        cfg_rank, ulysses_rank = divmod(rank, layout.ulysses)
        # A group of one rank runs no collective, so has no figure.
        named = {
            f"ulysses{cfg_rank}": (ulysses, layout.ulysses > 1),
            f"cfg{ulysses_rank}": (cfg, layout.cfg_parallel > 1),
        }
        links = {group: seconds for group, (seconds, real) in named.items() if real}
        paired = rank in partners and (partners[rank].to, partners[rank].from_) != (None, None)
        figures.append(
            ProbeFigures(
                rank=rank,
                compute_s=compute,
                links=links,
                cross_host_s=across if paired else None,
            )
        )
    return figures


def nccl_diagnostics_env(args: ServerArgs, *, folder: Path, rank: int) -> dict[str, str]:
    """The environment that turns on NCCL's own diagnostics for this rank's communicators
    (set before they are made), its report written to a file of its own in `folder`."""
    if not args.nccl_diagnostics:
        return {}
    return {
        **NCCL_DIAGNOSTICS,
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "INFO"),
        "NCCL_DEBUG_FILE": str(folder / f"nccl-diagnostics.rank{rank}.%p.log"),
    }


def nccl_report(args: ServerArgs, env: Mapping[str, str]) -> str | None:
    """What NCCL's diagnostics wrote so far (its lines that say diagnostics or RAS), cut to
    DIAGNOSTICS_CHARS; None when they were not asked for or wrote nothing."""
    pattern = env.get("NCCL_DEBUG_FILE", "")
    if not args.nccl_diagnostics or not pattern:
        return None
    path = Path(pattern.replace("%p", str(os.getpid())).replace("%h", socket.gethostname()))
    try:
        with path.open("rb") as file:
            text = file.read(1 << 20).decode(errors="replace")
    except OSError:
        return None
    kept = [line for line in text.splitlines() if re.search(r"diagnos|RAS", line, re.I)]
    return "\n".join(kept)[-DIAGNOSTICS_CHARS:] or None
