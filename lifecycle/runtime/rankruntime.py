"""What the actions of one rank's startup share (`RankRuntime`): its settings, its place in
the layout, its recorder, communicator and device, and what the startup has found so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lifecycle.core.decisions.compiling import CacheUse, CompileKey
from lifecycle.core.decisions.fingerprint import Reuse, StoredPlan
from lifecycle.core.decisions.warmupplan import WarmupPlan
from lifecycle.core.format.records import Fingerprint, Platform, RequestResult, ResidencyPlan, Role
from lifecycle.core.settings.config import RankLayout, ServerArgs
from lifecycle.runtime.device import MemoryMeter
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.group.slowdown import Slowdown
from lifecycle.runtime.keeping.keeperwire import KeeperLink
from lifecycle.runtime.pipeline import Pipeline
from lifecycle.runtime.recorder import Recorder


@dataclass
class RankRuntime:
    """What the actions of one rank share; filled in as the startup goes."""

    args: ServerArgs
    layout: RankLayout
    recorder: Recorder
    comm: Comm
    device: torch.device
    meter: MemoryMeter
    local_ranks: int
    pipeline: Pipeline | None = None
    platform: Platform | None = None
    plan: WarmupPlan | None = None
    dropped_buffers: bool = False
    # The warmup requests' results by role, for the residency planner.
    measured: dict[Role, RequestResult] = field(default_factory=dict)
    # The residency planner's state (lifecycle.runtime.residency).
    fingerprint: Fingerprint | None = None
    reuse: Reuse | None = None  # the reuse decision at gate-check, and why
    reused: StoredPlan | None = None  # the verified plan every rank agreed to reuse
    residency: ResidencyPlan | None = None  # the plan this rank runs, until a rollback
    residency_failure: str | None = None  # why applying it failed on this rank
    over_budget_fault: bool = False  # --fault RANK:re-warm:over-budget fired
    # --compile (lifecycle.runtime.compiler): the key, this rank's compiler cache folder, what
    # the journal's artifact did, the folder's files once it was loaded, and whether what it keeps
    # replaces the key's artifact (one loaded, or one found corrupt).
    compile_key: CompileKey | None = None
    compile_folder: Path | None = None
    compile_cache: CacheUse = CacheUse.OFF
    compile_files: frozenset[tuple[str, int]] = frozenset()
    compile_replaces: bool = False  # the key's artifact is kept anew in its place
    compile_seconds: float | None = None  # how long the compile action took
    # The host's keeper (lifecycle.runtime.keeping): the weights key, the keeper this rank
    # talks to (None: none), whether its weights came from it (attached, or another rank's
    # copy mapped after a load), whether the keeper holds what it serves with, their bytes.
    weights_key: str = ""
    keeper: KeeperLink | None = None
    attached: bool = False
    kept: bool = False
    group_keeping: bool = False  # some rank of the group attached or has a keeper (gate-check)
    weights_bytes: int = 0
    # A `slow` fault's model of a throttled device (none fired: factor 1, nothing stretched).
    slowdown: Slowdown = field(default_factory=Slowdown)

    @property
    def decodes(self) -> bool:
        """Rank 0 decodes and returns the video; the others stop after the DiT."""
        return self.layout.rank == 0

    @property
    def calibration_open(self) -> bool:
        return self.plan is not None and self.plan.calibration_open
