"""A weight file's share of a model's fingerprint, read in milliseconds whatever its size:
its name and size; for a safetensors file, each tensor's name, dtype and shape (from the
header) and its first TENSOR_SAMPLE_BYTES; for any other weight file (a `.bin` or `.pt` is a
pickle, never unpickled here), SAMPLES slices of SAMPLE_BYTES spread evenly over its bytes
(all of them when it holds fewer). So retrained weights of the same tensors are a new digest
without reading gigabytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lifecycle.adapters.diffusers.modelfiles import open_regular, read_at

SAFETENSORS = ".safetensors"
WEIGHT_SUFFIXES = (SAFETENSORS, ".bin", ".pt", ".pth", ".ckpt", ".gguf")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header
TENSOR_SAMPLE_BYTES = 256
SAMPLES = 16
SAMPLE_BYTES = 64 * 2**10


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


class NotWeights(ValueError):
    """A weight file that cannot be what its name says; why, in a few words ("is cut short
    (...)"), to follow the file's name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    """A tensor as a safetensors header describes it; its bytes' offsets are in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def digest_weights(digest: Digest, path: Path, relative: str) -> None:
    """Add the weight file at `path` (named `relative` in its directory) to `digest`;
    NotWeights for a safetensors file that is not one, OSError where it cannot be read."""
    with open_regular(path) as fd:
        size = os.fstat(fd).st_size
        if not relative.endswith(SAFETENSORS):
            digest.update(f"w {relative} {size}\n".encode())
            for offset, length in sample_spans(0, size):
                digest.update(read_at(fd, offset, length))
            return
        tensors = safetensors_tensors(fd, size)
        # Read in the file's order, so that the reads run forward through it.
        heads = {
            t.name: read_at(fd, t.start, min(t.end - t.start, TENSOR_SAMPLE_BYTES))
            for t in sorted(tensors, key=lambda t: t.start)
        }
    digest.update(f"w {relative} {size} safetensors\n".encode())
    for t in tensors:
        digest.update(f"t {json.dumps(t.name)} {t.dtype} {list(t.shape)}\n".encode())
        digest.update(heads[t.name])


def sample_spans(start: int, end: int) -> tuple[tuple[int, int], ...]:
    """The (offset, length) slices of [start, end) read of a weight file that is not a
    safetensors file."""
    if end - start <= SAMPLES * SAMPLE_BYTES:
        return ((start, end - start),) if end > start else ()
    stride = (end - start - SAMPLE_BYTES) // (SAMPLES - 1)
    return tuple((start + i * stride, SAMPLE_BYTES) for i in range(SAMPLES))


def safetensors_tensors(fd: int, size: int) -> tuple[Tensor, ...]:
    """The tensors of the safetensors file open at `fd` (`size` bytes), by name, from its
    header read alone and bounded; NotWeights when it is cut short or not one at all."""
    head = read_at(fd, 0, 8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if length > MAX_HEADER_BYTES:
        raise NotWeights(
            f"is not a safetensors file (its header would be {length:,} bytes, more than"
            f" safetensors allows, {MAX_HEADER_BYTES:,})"
        )
    if length < 2 or length > size - 8:
        raise NotWeights("is not a safetensors file (its header length does not fit the file)")
    try:
        doc = json.loads(read_at(fd, 8, length))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise NotWeights("is not a safetensors file (its header is not JSON)") from None
    if not isinstance(doc, dict):
        raise NotWeights("is not a safetensors file (its header is not a JSON object)")
    data_start = 8 + length
    tensors = []
    for name, entry in doc.items():
        if name == "__metadata__":
            continue
        described = _tensor(entry)
        if described is None:
            raise NotWeights(
                f"is not a safetensors file (tensor {name!r} has no dtype, shape and offsets)"
            )
        dtype, shape, (start, end) = described
        start, end = data_start + start, data_start + end
        tensors.append(Tensor(name=name, dtype=dtype, shape=shape, start=start, end=end))
    end = max((t.end for t in tensors), default=data_start)
    if end > size:
        raise NotWeights(f"is cut short ({size:,} bytes; its tensors need {end:,})")
    return tuple(sorted(tensors, key=lambda t: t.name))


def _tensor(entry: Any) -> tuple[str, tuple[int, ...], tuple[int, int]] | None:
    """A header entry's dtype, shape and data offsets; None when it is not one."""
    if not isinstance(entry, dict):
        return None
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(_count(n) for n in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_count(n) for n in offsets)
        and offsets[0] <= offsets[1]
    ):
        return dtype, tuple(shape), (offsets[0], offsets[1])
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
