"""A model directory's components loaded in parallel by the lifecycle against diffusers' own
serial `WanPipeline.from_pretrained`, on a directory of Wan 2.1 1.3B's size read from the page
cache; where the time goes, and the floor: the slowest component loaded alone.

Every load runs in a fresh worker process (bench.loadside), imported before it is timed, so
that neither side profits from the other's allocator or imports.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.procs import Pool
from bench.stats import median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most

TARGET = 0.75
WORKER = "bench.loadside"
WORKER_TIMEOUT_S = 1800.0
LIFECYCLE, DIFFUSERS = "lifecycle", "diffusers"
COMPONENTS = ("transformer", "text_encoder", "vae")
# What the rest of the machine keeps while a load runs: other processes, the kernel.
MEMORY_MARGIN_BYTES = 4 * 2**30
DISK_MARGIN_BYTES = 8 * 2**30
READ_CHUNK = 16 * 2**20


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    transformer_layers: int
    encoder_layers: int | None  # None: as many as fit this machine's memory and disk
    vocab: int
    rounds: int  # timed rounds, after the first (which verifies and is not timed)


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(transformer_layers=2, encoder_layers=1, vocab=4096, rounds=1)
    return Sized(transformer_layers=30, encoder_layers=None, vocab=256384, rounds=9)


def _available_bytes() -> int:
    text = Path("/proc/meminfo").read_text(encoding="utf-8")
    match = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise BenchError("/proc/meminfo has no MemAvailable")
    return int(match.group(1)) * 1024


def _in_worker(workdir: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """One payload in a fresh worker process, closed after."""
    with Pool(WORKER, size=1, workdir=workdir, timeout_s=WORKER_TIMEOUT_S) as pool:
        return pool.round([payload])[0]


def _warm(directory: Path) -> int:
    """Read every file once, so that the loads find them in the page cache; bytes read."""
    total = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        with path.open("rb", buffering=0) as handle:
            while chunk := handle.read(READ_CHUNK):
                total += len(chunk)
    return total


def _load(workdir: Path, directory: Path, side: str, *, digest: bool = False) -> dict[str, Any]:
    payload = {"task": "load", "side": side, "directory": str(directory), "digest": digest}
    return _in_worker(workdir, payload)


def _verified(first: dict[str, Any], second: dict[str, Any]) -> int:
    """The tensors both pipelines hold, each equal (dtype, shape, bytes); BenchError if not."""
    a, b = first["digests"], second["digests"]
    if not a or a.keys() != b.keys():
        only = sorted(a.keys() ^ b.keys()) or ["(none)"]
        raise BenchError(f"the pipelines' state dicts differ: {len(only)} names, e.g. {only[0]}")
    differ = sorted(name for name in a if a[name] != b[name])
    if differ:
        raise BenchError(f"{len(differ)} tensors differ between the two loads, e.g. {differ[0]}")
    if first["dtypes"] != second["dtypes"]:
        raise BenchError(f"the loads' dtypes differ: {first['dtypes']} against {second['dtypes']}")
    return len(a)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _interval(ratios: Sequence[float]) -> str:
    found = median_interval(ratios)
    return (
        f"[{format_ratio(found.low)}, {format_ratio(found.high)}] with {found.coverage:.1%}"
        " confidence (sign test)"
    )


def _per_component(loads: Sequence[list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each component's median seconds, read and device time, from the load_finished events."""
    found: dict[str, dict[str, float]] = {}
    for name in COMPONENTS:
        events = [e for one in loads for e in one if e["component"] == name]
        if not events:
            raise BenchError(f"the lifecycle's loads journaled no load_finished for {name}")
        if not all(e["ok"] for e in events):
            raise BenchError(f"a load_finished of {name} says it failed")
        found[name] = {k: median([e[k] for e in events]) for k in ("seconds", "read_s", "device_s")}
    return found


def measure(settings: Settings) -> list[Row]:
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return [missing_extra("parallel load: not run", extra="diffusers")]
    # Its own directory, removed as soon as it is measured: the files are GBs.
    with tempfile.TemporaryDirectory(prefix="parallel-load-", dir=settings.workdir) as scratch:
        return _measured(settings, Path(scratch))


def _measured(settings: Settings, workdir: Path) -> list[Row]:
    sized = _sized(settings)
    directory = workdir / "wan-1.3b"
    memory = _available_bytes() - MEMORY_MARGIN_BYTES
    disk = shutil.disk_usage(workdir).free - DISK_MARGIN_BYTES
    progress(
        f"parallel-load: writing the directory ({_gb(memory)} of memory and {_gb(disk)} of disk"
        " for it)"
    )
    built = _in_worker(
        workdir,
        {"task": "build", "directory": str(directory), "vocab": sized.vocab,
         "transformer_layers": sized.transformer_layers, "encoder_layers": sized.encoder_layers,
         "memory_bytes": memory, "disk_bytes": disk},
    )  # fmt: skip
    built["memory_bytes"], built["disk_free_bytes"] = memory, disk
    warmed = _warm(directory)
    progress(f"parallel-load: {_gb(warmed)} read; verifying, and each component alone once")
    first_a = _load(workdir, directory, LIFECYCLE, digest=True)
    first_b = _load(workdir, directory, DIFFUSERS, digest=True)
    tensors = _verified(first_a, first_b)
    alone_once = {name: _load(workdir, directory, name)["seconds"] for name in COMPONENTS}
    floor_name = max(alone_once, key=alone_once.__getitem__)
    sides = (LIFECYCLE, DIFFUSERS, floor_name)
    samples: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for index in range(sized.rounds):
        progress(f"parallel-load: round {index + 1}/{sized.rounds}")
        turn = index % len(sides)
        for side in (*sides[turn:], *sides[:turn]):  # each side first in turn
            samples[side].append(_load(workdir, directory, side))
    progress("parallel-load: each component's load step by step")
    dtypes = {name: first_a["dtypes"][name] for name in COMPONENTS}
    steps = {
        name: _in_worker(workdir, {"task": "steps", "directory": str(directory),
                                   "component": name, "dtype": dtypes[name]})
        for name in COMPONENTS
    }  # fmt: skip
    return _rows(sized, built, warmed, tensors, samples, floor_name, alone_once, steps)


def _directory_text(sized: Sized, built: dict[str, Any], sizes: dict[str, int]) -> str:
    params = built["parameters"]
    if sized.encoder_layers is not None:
        fit = "--quick sizes"
    else:
        limit = {
            "UMT5-XXL": "all of UMT5-XXL's layers fit",
            "memory": "sized down to what fits this machine's memory",
            "disk": "sized down to what fits the free disk",
        }[built["limited_by"]]
        fit = (
            f"the encoder's layers: {limit} ({_gb(built['memory_bytes'])} of MemAvailable less 4"
            f" GiB for the files in the page cache and one load's own memory, the diffusers"
            f" models as float32 and the process 1.5 GiB; {_gb(built['disk_free_bytes'])} of"
            " free disk less 8 GiB for the files)"
        )
    return (
        f"transformer: Wan 2.1 T2V 1.3B's config, {sized.transformer_layers} layers,"
        f" {params['transformer'] / 1e9:.2f}B parameters, {_gb(sizes['transformer'])}; text"
        f" encoder: UMT5-XXL's width (d_model 4096, d_ff 10240, 64 heads),"
        f" {built['encoder_layers']} of its 24 layers, vocabulary {sized.vocab},"
        f" {params['text_encoder'] / 1e9:.2f}B parameters, {_gb(sizes['text_encoder'])}; vae:"
        f" Wan's, {_gb(sizes['vae'])}; random weights (normal, fixed seed), bf16, written by"
        f" WanPipeline.save_pretrained in shards of at most 2 GB ({fit})"
    )


def _rows(
    sized: Sized, built: dict[str, Any], warmed: int, tensors: int,
    samples: dict[str, list[dict[str, Any]]], floor_name: str, alone_once: dict[str, float],
    steps: dict[str, dict[str, Any]],
) -> list[Row]:  # fmt: skip
    a, b, floor = samples[LIFECYCLE], samples[DIFFUSERS], samples[floor_name]
    a_s, b_s, floor_s = ([x["seconds"] for x in side] for side in (a, b, floor))
    ratios = [x / y for x, y in zip(a_s, b_s, strict=True)]
    floor_ratios = [x / y for x, y in zip(floor_s, b_s, strict=True)]
    ratio, floor_ratio = median(ratios), median(floor_ratios)
    sizes = {name: steps[name]["bytes"] for name in COMPONENTS}
    dtypes = {name: steps[name]["dtype"] for name in COMPONENTS}
    disk = max(x["disk_bytes"] for side in samples.values() for x in side)
    peak = {side: median([x["peak_rss"] for x in samples[side]]) for side in (LIFECYCLE, DIFFUSERS)}
    cores = os.cpu_count() or 1
    busy_a = median([x["cpu_s"] / x["seconds"] for x in a])
    busy_b = median([x["cpu_s"] / x["seconds"] for x in b])
    how = (
        f"{_directory_text(sized, built, sizes)}; files read once before ({_gb(warmed)}), the"
        f" most any timed load read from disk: {disk} bytes (/proc/self/io); each load in a"
        f" fresh process, imports before the clock; {sized.rounds} rounds, the three sides' order"
        " rotating, values are medians, the ratio is the median of the paired ratios A/B, in"
        f" {_interval(ratios)}. A: load_components(WanPipeline, read_directory(DIR), cpu) (the"
        " walk and fingerprint, included:"
        f" {format_seconds(median([x['walked_s'] for x in a]))}); B:"
        " WanPipeline.from_pretrained(DIR, local_files_only=True) without torch_dtype, as the"
        " lifecycle's loader calls it, so that both load each library's default dtype: "
        + ", ".join(f"{name} {dtypes[name]}" for name in COMPONENTS)
        + f"; verified in a first round, not timed: all {tensors} state dict tensors equal"
        f" (sha256 of dtype, shape, bytes); cores busy (CPU time / wall) A {busy_a:.2f}, B"
        f" {busy_b:.2f} of {cores}; peak RSS A {_gb(peak[LIFECYCLE])}, B {_gb(peak[DIFFUSERS])}"
        " (mapped pages of the files included)"
    )
    per = _per_component([x["loads"] for x in a])
    return [
        Row(
            figure=f"parallel load: Wan 1.3B-sized directory from the page cache, {cores} cores",
            value=format_seconds(median(a_s)),
            baseline=f"{format_seconds(median(b_s))} WanPipeline.from_pretrained",
            **ratio_at_most(ratio, TARGET),
            how=how,
        ),
        Row(
            figure=f"parallel load: the floor, the slowest component ({floor_name}) alone",
            value=format_seconds(median(floor_s)),
            baseline=f"{format_seconds(median(b_s))} WanPipeline.from_pretrained",
            ratio=format_ratio(floor_ratio),
            target=f"{TARGET} reachable: {'yes' if floor_ratio <= TARGET else 'NO'}",
            how=(
                f"WanPipeline.from_pretrained(DIR, every other component None): the lifecycle's"
                f" own call for {floor_name}, in a fresh process, in each round beside A and B;"
                f" no load of these components in parallel can take less; paired ratio to B in"
                f" {_interval(floor_ratios)}; A less the floor:"
                f" {format_seconds(median([x - y for x, y in zip(a_s, floor_s, strict=True)]))}"
                " (median of pairs); each component alone once (which chose the floor): "
                + ", ".join(f"{n} {format_seconds(s)}" for n, s in alone_once.items())
                + f" (sum {format_seconds(sum(alone_once.values()))})"
            ),
        ),
        Row(
            figure="parallel load: each component in A, from its journaled load",
            value=", ".join(f"{n} {format_seconds(per[n]['seconds'])}" for n in COMPONENTS),
            how=(
                "the load_started/load_finished events A's loader journals (through"
                " recording_loads), medians over the rounds: "
                + "; ".join(
                    f"{n}: read (from_pretrained of it alone) {format_seconds(per[n]['read_s'])},"
                    f" to the device {format_seconds(per[n]['device_s'])}"
                    for n in COMPONENTS
                )
                + "; the components overlap, so they add up to more than A"
            ),
        ),
        *_step_rows(steps, {**alone_once, floor_name: median(floor_s)}),
    ]


def _step_rows(steps: dict[str, dict[str, Any]], alone: dict[str, float]) -> list[Row]:
    tensor_s = {n: s["one_pass_s"] for n, s in steps.items()}
    python_s = {n: max(0.0, alone[n] - tensor_s[n]) for n in steps}
    rows = []
    for name, step in steps.items():
        rows.append(
            Row(
                figure=f"parallel load: {name} step by step ({step['dtype']})",
                value=f"{format_seconds(tensor_s[name])} tensors, {format_seconds(python_s[name])}"
                " the rest",
                how=(
                    f"one worker, torch on every core, its {step['tensors']} tensors"
                    f" ({_gb(step['bytes'])}) a group of at most 1 GiB at a time: the skeleton"
                    f" on the meta device (Python, holds the GIL)"
                    f" {format_seconds(step['skeleton_s'])}; mapping the safetensors files"
                    f" {format_seconds(step['map_s'])}; reading every page from the page cache"
                    f" (a copy into written memory) {format_seconds(step['read_s'])}; fresh"
                    f" memory for {step['dtype']} (allocated and first written, the kernel's page"
                    f" faults) {format_seconds(step['fresh_s'])}; the cast into written memory"
                    f" {format_seconds(step['cast_s'])}; the loaders' one pass, tensor.to("
                    f"{step['dtype']}) from a fresh mapping, {format_seconds(tensor_s[name])}"
                    f" ({step['aliased']} of {step['tensors']} tensors left in the mapping,"
                    " neither copied nor cast); the rest, from_pretrained of it alone less that"
                    f" pass (its Python, the GIL held, with the skeleton):"
                    f" {format_seconds(python_s[name])}; read from disk meanwhile:"
                    f" {step['disk_bytes']} bytes"
                ),
            )
        )
    rows.append(
        Row(
            figure="parallel load: what holds the GIL, in one thread",
            value=format_seconds(sum(python_s.values())),
            how=(
                "the rest of each component's load alone beyond its tensors' one pass (above),"
                " summed: Python that holds the GIL and so runs one thread at a time however"
                " many load; of it, the skeletons "
                + format_seconds(sum(s["skeleton_s"] for s in steps.values()))
                + " (built one at a time under the loader's lock in any case)"
            ),
        )
    )
    return rows


BENCHMARK = Benchmark(name="parallel-load", measure=measure)
