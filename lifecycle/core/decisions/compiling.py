"""What a startup pays once per fingerprint (pure): the key a compiled denoiser's artifacts are
kept under, and why a stored artifact is not used. See docs/compile.md."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from enum import StrEnum

from lifecycle.core.format.events import Compiled, CompileEvent, CompileKept
from lifecycle.core.format.text import format_bytes

# An artifact larger than this is not kept (journaled why): a compiler cache of a large model
# with its autotuning results is tens of MB; past a GiB something other than kernels is in it.
MAX_ARTIFACT_BYTES = 1 << 30
# Artifacts kept per model: the newest of each key, and of the keys the newest this many; a
# store past it removes the oldest, so that a journal never holds more than a few per model.
KEPT_PER_MODEL = 8


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
