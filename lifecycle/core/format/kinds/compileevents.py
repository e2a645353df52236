"""What a startup pays once per fingerprint, as its journal says it: the denoiser compiled (and
what the journal's artifacts did for it), its artifacts kept, and the learned shapes chosen to
warm within their budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lifecycle.core.format.kinds.eventkind import Event
from lifecycle.core.format.records import ChosenShape, SkippedShape


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileEvent(Event):
    """A step of what is paid once per fingerprint: compiled, its artifact kept, or the
    learned shapes chosen to warm."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Compiled(CompileEvent):
    """The denoiser's repeated block compiled (torch.compile), or why not (`cache` "off"):
    how long compiling took (a one-step request at the bounded shape that runs it), and what
    the journal's artifacts did for it: loaded (hit), none of its key (miss), or found and not
    used (rejected, `reason` says why)."""

    kind: ClassVar[str] = "compiled"
    key: str | None  # the compile key (None: nothing compiled)
    blocks: int  # the blocks compiled
    backend: str
    mode: str
    seconds: float
    cache: str  # a CacheUse
    reason: str | None
    artifact_bytes: int  # the artifact loaded (hit), else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileKept(CompileEvent):
    """After the warmups, the compiler's artifacts kept in the journal for the next startup of
    the key, or why not (`kept` false: too large, another pod kept one first, a write that
    failed)."""

    kind: ClassVar[str] = "compile_kept"
    key: str
    bytes: int
    kept: bool
    reason: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ShapesChosen(CompileEvent):
    """Rank 0's choice of the shapes warmed after the bounded warmup (the learned ones and
    --warm-shape's), before any is: the budget and where it came from, each shape chosen with
    its expected cost, and each learned shape left out with why."""

    kind: ClassVar[str] = "shapes_chosen"
    budget_s: float
    budget_basis: str  # "--warm-budget", or how the default was reached
    chosen: tuple[ChosenShape, ...]
    skipped: tuple[SkippedShape, ...]
