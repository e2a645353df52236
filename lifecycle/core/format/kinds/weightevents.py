"""The finished weights of a fingerprint as a rank's journal says it: taken from the host's
keeper (attach) or loaded from disk (load), given to the keeper, checked against the
fingerprint's reference output, rejected, and released while the server sleeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.format.kinds.compileevents import CompileEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsPath(CompileEvent):
    """How this rank got its pipeline's finished weights: `attach` (the keeper held the
    weights key, mapped in `seconds`) or `load` (from disk; `reason` says why not attached),
    with the bytes of weights the rank holds."""

    kind: ClassVar[str] = "weights_path"
    path: str  # "attach" or "load"
    key: str  # the weights key (lifecycle.core.decisions.weightskey)
    keeper: str  # the keeper's socket, or "" when none is used
    bytes: int
    seconds: float
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsKept(CompileEvent):
    """The loaded weights offered to the keeper: `kept` (it holds them now, and this rank maps
    its copy), `held` (it held them already: this rank maps that copy instead of its own),
    `refused` (over its memory budget) or `failed` (`reason`); the startup goes on either way."""

    kind: ClassVar[str] = "weights_kept"
    key: str
    outcome: str
    bytes: int
    seconds: float
    reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferenceOutput(CompileEvent):
    """The weights key's reference output on this rank: the digest of the fixed warmup request
    (the bounded shape) that an attached startup must reproduce before it may be ready;
    `since_run` is the run that first journaled it (this run's own when it is the first)."""

    kind: ClassVar[str] = "reference_output"
    key: str
    checksum: str
    since_run: str
    outcome: str  # "new", "matched", or "replaced" (weights loaded from disk differed)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttachRejected(CompileEvent):
    """Weights from the keeper this rank will not serve with: their output differed from the
    reference, or what the keeper answered was not what was asked for; the rank loads from disk
    (fail closed)."""

    kind: ClassVar[str] = "attach_rejected"
    key: str
    what: str  # what differed, in words
    expected: str
    observed: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsReleased(CompileEvent):
    """Going to sleep: the rank let its weights go (`bytes`; the keeper keeps them), or kept
    them where no keeper holds them (`bytes` 0, `reason`). `device_bytes`: the device memory
    given back, measured (CUDA's allocator's reserve before and after); None where there is no
    such measure (a CPU's weights are the keeper's shared memory, which stays)."""

    kind: ClassVar[str] = "weights_released"
    key: str
    bytes: int
    seconds: float
    reason: str | None = None
    device_bytes: int | None = None
