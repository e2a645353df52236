"""What gate-check found of the ranks themselves, as each rank's journal says it: what it runs
on and how that differs from its peers, its probes' figures, and whether it was found slow
(docs/ranks.md, "The gate checks the ranks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.format.kinds.eventkind import Event


@dataclass(frozen=True, slots=True, kw_only=True)
class RankEnvironment:
    """What one rank runs on: versions, its device, and the dtype its weights are in. A field
    this rank cannot tell (NCCL on a CPU rank, a driver without one) is ""."""

    host: str
    torch: str
    cuda: str
    nccl: str
    driver: str
    python: str
    device: str  # the device's name
    capability: str  # CUDA compute capability ("9.0"), or the CPU's vector ISA torch uses
    memory_bytes: int
    dtype: str  # the floating dtypes of the pipeline's weights, sorted ("bfloat16,float32")


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvironmentDifference:
    """A field the ranks do not agree on: the value most ranks have (rank 0's on a tie), and
    the ranks that have another, with theirs. `matters` when it changes numerics or
    collectives (the startup fails); otherwise it is a warning."""

    field: str
    matters: bool
    expected: str
    expected_ranks: tuple[int, ...]
    ranks: tuple[int, ...]
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFigure:
    """One group's timed all-to-all as this rank measured it: the best of its repetitions."""

    group: str
    seconds: float
    bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCheckEvent(Event):
    """A step of gate-check's check of the ranks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvironmentChecked(RankCheckEvent):
    """This rank's environment, and every field the group's ranks differ in."""

    kind: ClassVar[str] = "environment_checked"
    environment: RankEnvironment
    differences: tuple[EnvironmentDifference, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProbed(RankCheckEvent):
    """This rank's probe figures: the fixed matmul's best time (`compute_flop` floating point
    operations) and each of its groups' timed all-to-all; with NCCL's own diagnostics report
    for the gate's communicators when they were asked for."""

    kind: ClassVar[str] = "rank_probed"
    host: str
    device: str
    compute_s: float
    compute_flop: int
    links: tuple[LinkFigure, ...] = ()
    diagnostics: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SlowRank(RankCheckEvent):
    """This rank measured below `threshold` of its group's median: its figure and the median
    (seconds, lower is faster), their ratio (the rank's speed against the median's), and what
    --on-slow-rank made of it (`warn`: the startup went on; `fail`: it stopped)."""

    kind: ClassVar[str] = "slow_rank"
    measure: str  # "compute", or "link" (of `group`)
    group: str  # "world" for compute
    figure_s: float
    median_s: float
    ratio: float
    threshold: float
    action: str
