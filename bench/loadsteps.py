"""One component's load from a pipeline directory taken apart, each step timed on its own in the
worker (bench.loadside): building the model's empty skeleton, mapping its safetensors files,
reading their pages from the page cache, making fresh memory for the loaded dtype, casting into
it, and the one pass the loaders make (read, cast and fresh memory at once).

The skeleton is Python throughout and so holds the GIL; the tensor steps run in torch's kernels
and the kernel's page faults, on torch's threads, without it. The tensor steps go a group of
tensors at a time (at most GROUP_BYTES of the files each), so that a component of many GB
needs no more memory than a group's beside the page cache.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

DIFFUSERS_CLASSES = {"transformer": "WanTransformer3DModel", "vae": "AutoencoderKLWan"}
GROUP_BYTES = 2**30


@dataclass(kw_only=True)
class StepTimes:
    """Seconds of each tensor step, summed over the groups."""

    read_s: float = 0.0
    fresh_s: float = 0.0
    cast_s: float = 0.0
    one_pass_s: float = 0.0
    aliased: int = 0  # tensors the one pass left in the mapping (no cast, no copy)
    tensors: list[str] = field(default_factory=list)


def disk_bytes() -> int:
    """Bytes this process has had fetched from storage (not served by the page cache)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _mapped(folder: Path) -> dict[str, Any]:
    """Every tensor of the folder's safetensors files, as views of a fresh mapping."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                tensors[key] = handle.get_tensor(key)
    return tensors


def _groups(tensors: dict[str, Any]) -> Iterator[list[str]]:
    """The tensors' names in groups of at most GROUP_BYTES (a larger tensor alone)."""
    group: list[str] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > GROUP_BYTES:
            yield group
            group, size = [], 0
        group.append(name)
        size += nbytes
    if group:
        yield group


def _timed(step: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = step()
    return time.perf_counter() - started, result


def _written_like(source: dict[str, Any], names: list[str], dtype: Any) -> dict[str, Any]:
    """Fresh tensors of the sources' shapes in `dtype` (None: each source's), every page
    written (faulted in)."""
    import torch

    return {
        k: torch.empty(source[k].shape, dtype=source[k].dtype if dtype is None else dtype).fill_(0)
        for k in names
    }


def _copy_into(destination: dict[str, Any], source: dict[str, Any]) -> None:
    for name, tensor in destination.items():
        tensor.copy_(source[name])


def _one_pass(source: dict[str, Any], names: list[str], dtype: Any) -> dict[str, Any]:
    return {k: source[k].to(dtype) for k in names}


def _skeleton(folder: Path, component: str) -> Callable[[], Any]:
    import torch

    def build() -> Any:
        with torch.device("meta"):
            if component in DIFFUSERS_CLASSES:
                import diffusers

                cls = getattr(diffusers, DIFFUSERS_CLASSES[component])
                return cls.from_config(cls.load_config(str(folder)))
            from transformers import UMT5Config, UMT5EncoderModel

            return UMT5EncoderModel(UMT5Config.from_pretrained(str(folder)))

    return build


def _tensor_steps(folder: Path, target: Any) -> StepTimes:
    times = StepTimes()
    source = _mapped(folder)
    for names in _groups(source):
        # A destination written before it is timed: the read alone (a copy, same dtype).
        same = _written_like(source, names, None)
        seconds, _ = _timed(partial(_copy_into, same, source))
        times.read_s += seconds
        same.clear()
        seconds, cast_into = _timed(partial(_written_like, source, names, target))
        times.fresh_s += seconds
        seconds, _ = _timed(partial(_copy_into, cast_into, source))
        times.cast_s += seconds
        cast_into.clear()
    source.clear()
    # The loaders' pass, on a fresh mapping: pages already in the page cache, not yet mapped.
    source = _mapped(folder)
    for names in _groups(source):
        seconds, loaded = _timed(partial(_one_pass, source, names, target))
        times.one_pass_s += seconds
        times.aliased += sum(
            loaded[k].untyped_storage().data_ptr() == source[k].untyped_storage().data_ptr()
            for k in names
        )
        loaded.clear()
    times.tensors = list(source)
    return times


def steps(directory: str, component: str, dtype: str) -> dict[str, Any]:
    """Seconds of each step of `component`'s load into `dtype` (the dtype the loaders gave it),
    with torch on every core, and the bytes its files hold."""
    import torch

    folder = Path(directory) / component
    target = getattr(torch, dtype.removeprefix("torch."))
    disk = disk_bytes()
    skeleton_s, _ = _timed(_skeleton(folder, component))
    map_s, _ = _timed(partial(_mapped, folder))
    times = _tensor_steps(folder, target)
    return {
        "component": component,
        "dtype": dtype.removeprefix("torch."),
        "bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
        "tensors": len(times.tensors),
        "skeleton_s": skeleton_s,
        "map_s": map_s,
        "read_s": times.read_s,
        "fresh_s": times.fresh_s,
        "cast_s": times.cast_s,
        "one_pass_s": times.one_pass_s,
        "aliased": times.aliased,
        "disk_bytes": disk_bytes() - disk,
    }


if __name__ == "__main__":  # a manual check: python -m bench.loadsteps DIR COMPONENT DTYPE
    import sys

    print(json.dumps(steps(*sys.argv[1:4])))
