"""What a startup pays once per fingerprint (pure): the key a compiled denoiser's artifacts are
kept under, why a stored artifact is not used, and which of the shapes traffic used to warm
within a budget. See the README's "Compile and shapes, paid once per fingerprint"."""

from __future__ import annotations

import hashlib
import json
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum

from lifecycle.core.format.events import Compiled, CompileEvent, CompileKept
from lifecycle.core.format.records import Shape
from lifecycle.core.format.text import format_bytes
from lifecycle.core.settings.config import MAX_LEARNED_SHAPES

# An artifact larger than this is not kept (journaled why): a compiler cache of a large model
# with its autotuning results is tens of MB; past a GiB something other than kernels is in it.
MAX_ARTIFACT_BYTES = 1 << 30
# Artifacts kept per model: the newest of each key, and of the keys the newest this many; a
# store past it removes the oldest, so that a journal never holds more than a few per model.
KEPT_PER_MODEL = 8
# The served requests a startup reads to learn shapes from: the newest runs of its fingerprint,
# and of each the newest requests (bounded reads, on a journal of months of serving).
LEARN_RUNS = 16
LEARN_REQUESTS_PER_RUN = 1000
# A learned shape is warmed at a few steps: what a shape costs the first time (compiling,
# allocating, planning kernels) is paid by its first step; the others add nothing to learn.
LEARNED_WARM_STEPS = 2
# --warm-budget's default: a quarter of the fingerprint's median time to ready, so that warming
# never makes a startup much longer than its history; with no history, this many seconds.
WARM_BUDGET_SHARE = 0.25
WARM_BUDGET_FLOOR_S = 10.0


class CacheUse(StrEnum):
    """What a compile made of the journal's artifacts."""

    HIT = "hit"  # an artifact of this key was loaded before compiling
    MISS = "miss"  # none of this key: compiled cold, and kept for the next startup
    REJECTED = "rejected"  # one was found and not used (stale or corrupt): compiled cold
    OFF = "off"  # nothing compiled: --compile not given, or the pipeline declares no blocks


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileKey:
    """Everything compiled code depends on: the model and its layout (the fingerprint), the
    compiler (torch, Python, the machine) and its options."""

    fingerprint: str  # the residency fingerprint's key (model, layout, device, torch, budget)
    model: str
    torch: str
    python: str
    machine: str  # the CPU architecture, and the accelerator where there is one
    backend: str
    mode: str

    @property
    def key(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def options(self) -> str:
        return f"backend={self.backend} mode={self.mode}"


def stale_reason(mine: CompileKey, stored: CompileKey) -> str:
    """Why an artifact stored under `stored` is not loaded by a startup of `mine`, in words."""
    said = []
    if stored.torch != mine.torch:
        said.append(f"compiled by torch {stored.torch}, this is torch {mine.torch}")
    if stored.python != mine.python:
        said.append(f"compiled under Python {stored.python}, this is {mine.python}")
    if (stored.backend, stored.mode) != (mine.backend, mine.mode):
        said.append(f"compiled with {stored.options}, this asks {mine.options}")
    if stored.machine != mine.machine:
        said.append(f"compiled on {stored.machine}, this is {mine.machine}")
    if stored.fingerprint != mine.fingerprint and not said:
        said.append("compiled for another layout, device or model configuration")
    return "; ".join(said) or "another key"


def is_digest(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True, slots=True, kw_only=True)
class Served:
    """One request that a run of the fingerprint served: its shape, steps and seconds (None
    when it did not finish)."""

    shape: Shape
    steps: int
    seconds: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnedTraffic:
    """What a fingerprint's newest healthy runs served, and their times to ready."""

    requests: list[Served]
    ready_s: list[float]


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnedShape:
    shape: Shape
    served: int  # how many requests used it
    steps: int  # the step count most used at it
    expected_s: float | None  # a request's median time there, from history


def learned_shapes(served: Iterable[Served], *, skip: Sequence[Shape] = ()) -> list[LearnedShape]:
    """The shapes traffic used, the most used first (ties: the smaller first), without those
    in `skip` (warmed already), at most MAX_LEARNED_SHAPES."""
    by_shape: dict[Shape, list[Served]] = {}
    for request in served:
        by_shape.setdefault(request.shape, []).append(request)
    learned = []
    for shape, requests in by_shape.items():
        if shape in skip:
            continue
        steps = Counter(r.steps for r in requests).most_common(1)[0][0]
        per_step = [r.seconds / r.steps for r in requests if r.seconds is not None and r.steps]
        expected = statistics.median(per_step) * LEARNED_WARM_STEPS if per_step else None
        learned.append(
            LearnedShape(shape=shape, served=len(requests), steps=steps, expected_s=expected)
        )
    learned.sort(key=lambda s: (-s.served, s.shape.pixels, str(s.shape)))
    return learned[:MAX_LEARNED_SHAPES]


def warm_budget(given_s: float | None, ready_s: Sequence[float]) -> float:
    """--warm-budget, or its default from the fingerprint's times to ready."""
    if given_s is not None:
        return given_s
    if not ready_s:
        return WARM_BUDGET_FLOOR_S
    return max(WARM_BUDGET_FLOOR_S, WARM_BUDGET_SHARE * statistics.median(ready_s))


def within_budget(shapes: Sequence[LearnedShape], *, budget_s: float) -> tuple[LearnedShape, ...]:
    """The shapes to warm, decided before any is (so that every rank warms the same ones): in
    order, each whose expected time still fits what is left of the budget; a shape history
    has no time for is expected to cost what the most expensive one known does."""
    known = [s.expected_s for s in shapes if s.expected_s is not None]
    unknown_s = max(known, default=0.0)
    left = budget_s
    chosen = []
    for shape in shapes:
        cost = shape.expected_s if shape.expected_s is not None else unknown_s
        if cost > left:
            continue
        chosen.append(shape)
        left -= cost
    return tuple(chosen)


def kept_text(event: CompileKept) -> str:
    """A `compile_kept` event in a few words, as the boot's table and `replay show` say it."""
    if event.kept:
        size = format_bytes(event.bytes) if event.bytes >= 2**20 else f"{event.bytes:,} bytes"
        return f"kept the compiler's artifact ({size})"
    return f"compiler's artifact not kept: {event.reason}"


def compiled_text(event: Compiled) -> str:
    """A `compiled` event in a few words, as the boot's table and `replay show` say it."""
    if event.cache == CacheUse.OFF:
        return f"not compiled: {event.reason}"
    cache = {
        CacheUse.HIT: f"from the journal's artifact ({event.artifact_bytes:,} bytes)",
        CacheUse.MISS: "cold (no artifact of its key)",
        CacheUse.REJECTED: f"cold ({event.reason})",
    }.get(CacheUse(event.cache), event.cache)
    said = f"compiled {event.blocks} blocks ({event.mode}) in {event.seconds:.2f} s, {cache}"
    if event.cache == CacheUse.MISS and event.reason:
        said += f"; {event.reason}"
    return said


def compile_text(event: CompileEvent) -> str:
    """A step of the compile in a few words: compiled, or its artifact kept."""
    if isinstance(event, Compiled):
        return compiled_text(event)
    assert isinstance(event, CompileKept)
    return kept_text(event)
