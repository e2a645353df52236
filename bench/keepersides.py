"""The keeper benchmark's measured sides, and the model directory that its rows 1 and 2 load."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from bench.bootrun import run_ids, run_to_exit
from bench.keeperprocs import (
    ATTACH,
    BOOT_OPTIONS,
    BOOT_TIMEOUT_S,
    DIRECTORY_OPTIONS,
    FOUR_RANKS,
    KEY_VAR,
    LOAD,
    MICRO,
    OFF,
    Mapped,
    Started,
    journaled,
    kill,
    mapped_by,
    new_run,
    post,
    running_keeper,
    serving,
)
from bench.loadside import BF16_BYTES, FP32_BYTES, PROCESS_BYTES, UMT5_XXL, WAN_1_3B
from bench.parallelload import MEMORY_MARGIN_BYTES as LOAD_MARGIN_BYTES
from bench.parallelload import _available_bytes, _in_worker, _warm
from bench.procs import Pool
from bench.suite import BenchError, Settings, progress

WAN_LAYERS = 30  # Wan 2.1 T2V 1.3B's transformer
ENCODER_LAYERS = 1
WORKER = "bench.keepersides"  # this module, as the worker that attaches alone
WORKER_TIMEOUT_S = 600.0
# What the rest of the machine keeps: the parallel load's margin, and 2 GiB more for the other
# work of a shared machine, which a keeper's copy and a load's beside it leave little room for.
MEMORY_MARGIN_BYTES = LOAD_MARGIN_BYTES + 2 * 2**30


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    transformer_layers: int | None  # None: as many as fit this machine's memory
    vocab: int
    pairs: int  # row 1: attach and cold boots, alternated
    restarts: int  # row 2: keeper and --keeper off restarts, alternated
    rounds: int  # rows 3 and 4


def sizes(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(transformer_layers=2, vocab=4096, pairs=1, restarts=1, rounds=1)
    return Sized(transformer_layers=None, vocab=4096, pairs=5, restarts=3, rounds=3)


# --- the model directory ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    """Parameters of a directory: all but the transformer's layers, and one of those."""

    base: int
    per_layer: int


def counted(vocab: int) -> Counts:
    """bench.loadside's models counted on the meta device (nothing allocated)."""
    import torch
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    def count(module: Any) -> int:
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        one = count(WanTransformer3DModel(**WAN_1_3B, num_layers=1))
        two = count(WanTransformer3DModel(**WAN_1_3B, num_layers=2))
        config = UMT5Config(vocab_size=vocab, num_layers=ENCODER_LAYERS, **UMT5_XXL)
        rest = count(UMT5EncoderModel(config)) + count(AutoencoderKLWan())
    return Counts(base=2 * one - two + rest, per_layer=two - one)


def layers_that_fit(*, memory_bytes: int, copies: int, counts: Counts) -> int:
    """The most transformer layers (at most Wan 1.3B's) of a directory whose `copies` float32
    copies fit in `memory_bytes` beside its bf16 files in the page cache; 0 when none fits."""
    params = memory_bytes // (FP32_BYTES * copies + BF16_BYTES)
    return int(max(0, min(WAN_LAYERS, (params - counts.base) // counts.per_layer)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Directory:
    path: Path
    layers: int
    vocab: int
    parameters: dict[str, int]
    file_bytes: int
    fit: str  # how its size was chosen, in words

    @property
    def float32_bytes(self) -> int:
        return FP32_BYTES * sum(self.parameters.values())

    def text(self) -> str:
        p = self.parameters
        return (
            f"transformer: Wan 2.1 T2V 1.3B's config at {self.layers} of its {WAN_LAYERS}"
            f" layers, {p['transformer'] / 1e9:.2f}B parameters; text encoder: UMT5-XXL's width,"
            f" {ENCODER_LAYERS} of its 24 layers, vocabulary {self.vocab},"
            f" {p['text_encoder'] / 1e9:.2f}B; vae: Wan's, {p['vae'] / 1e9:.2f}B; random weights"
            f" written bf16 by bench.loadside's builder (WanPipeline.save_pretrained,"
            f" {_gb(self.file_bytes)} of files, read once before), loaded as float32:"
            f" {_gb(self.float32_bytes)} a copy ({self.fit})"
        )


def write_directory(
    settings: Settings, workdir: Path, name: str, *, copies: int, ranks: int,
    counts: Callable[[], Counts],
) -> Directory:  # fmt: skip
    """A directory written by bench.loadside's builder in a worker, its files read once so that
    loads find them in the page cache; sized so that `copies` float32 copies of it, its files and
    `ranks` rank processes fit this machine's available memory less a margin."""
    sized = sizes(settings)
    available = _available_bytes()
    memory = available - MEMORY_MARGIN_BYTES - ranks * PROCESS_BYTES
    if sized.transformer_layers is None:
        layers = layers_that_fit(memory_bytes=memory, copies=copies, counts=counts())
        if layers < 1:
            raise BenchError(
                f"{_gb(available)} of available memory holds no directory {copies} times over"
            )
        fit = (
            f"the transformer's layers: as many as let {copies} float32 copies, the files in the"
            f" page cache and {ranks} rank process(es) of 1.5 GiB fit {_gb(available)} of"
            f" MemAvailable less {MEMORY_MARGIN_BYTES / 2**30:.0f} GiB"
        )
    else:
        layers, fit = sized.transformer_layers, "--quick sizes"
    path = workdir / name
    progress(f"keeper: writing {name} ({layers} transformer layers)")
    built = _in_worker(
        workdir,
        {"task": "build", "directory": str(path), "vocab": sized.vocab,
         "transformer_layers": layers, "encoder_layers": ENCODER_LAYERS,
         "memory_bytes": memory, "disk_bytes": 0},
    )  # fmt: skip
    return Directory(
        path=path, layers=layers, vocab=sized.vocab, parameters=built["parameters"],
        file_bytes=_warm(path), fit=fit,
    )  # fmt: skip


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


# --- the measures ----------------------------------------------------------------------------


def _boot(directory: Directory, keeper: str, *, db: Path, env: Mapping[str, str]) -> Started:
    """`lifecycle boot --model-path DIR BOOT_OPTIONS --keeper KEEPER` to its exit."""
    before = run_ids(db)
    command = [sys.executable, "-m", "lifecycle", "boot", "--model-path", str(directory.path),
               *BOOT_OPTIONS, "--keeper", keeper, "--db", str(db)]  # fmt: skip
    run_to_exit(command, cwd=db.parent, env=env, timeout_s=BOOT_TIMEOUT_S, ranks=1)
    return journaled(db, new_run(db, before), ranks=1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Boots:
    """Row 1's boots: the fill, then the attached and cold ones, pair by pair."""

    fill: Started
    attached: tuple[Started, ...]
    cold: tuple[Started, ...]
    alone: tuple[dict[str, Any], ...]  # the attach alone, in a worker (task)


def measure_boots(
    settings: Settings, directory: Directory, folder: Path, env: Mapping[str, str]
) -> Boots:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "boots.db"
    pairs = sizes(settings).pairs
    with running_keeper(folder / "keeper", env) as keeper:
        progress("keeper: a boot that loads and gives its weights to the keeper")
        fill = _boot(directory, str(keeper.socket), db=db, env=env)
        fill.expect("gate-check", LOAD, "the first boot")
        if fill.kept != ("kept",):
            raise BenchError(f"the first boot's weights_kept: {fill.kept}, expected kept")
        attached: list[Started] = []
        cold: list[Started] = []
        alone: list[dict[str, Any]] = []
        payload = {"socket": str(keeper.socket), "secret": env[KEY_VAR],
                   "key": fill.paths("gate-check")[0].key}  # fmt: skip

        def boot(seen: list[Started], which: str, path: str) -> Callable[[], None]:
            def run() -> None:
                started = _boot(directory, which, db=db, env=env)
                started.expect("gate-check", path, f"a boot with --keeper {which}")
                seen.append(started)

            return run

        def attach_alone() -> None:
            alone.append(_attach_alone(folder, payload))

        sides = [boot(attached, str(keeper.socket), ATTACH), boot(cold, OFF, LOAD), attach_alone]
        for index in range(pairs):
            progress(
                f"keeper: attached and cold boots, the attach alone, round {index + 1}/{pairs}"
            )
            turn = index % len(sides)
            for side in (*sides[turn:], *sides[:turn]):  # each side first in turn
                side()
    return Boots(fill=fill, attached=tuple(attached), cold=tuple(cold), alone=tuple(alone))


def _attach_alone(folder: Path, payload: dict[str, Any]) -> dict[str, Any]:
    with Pool(WORKER, size=1, workdir=folder, timeout_s=WORKER_TIMEOUT_S) as pool:
        return pool.round([payload])[0]


def task(payload: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """The worker's side (bench.procs): the keeper's weights attached alone, by the call a
    boot's gate-check makes, in a process that imported what a boot imports (bench.loadside's
    prepare) and collected its garbage before the clock; then one full collection, timed."""
    import gc
    from types import SimpleNamespace

    import torch

    from bench.loadside import prepare
    from lifecycle.runtime.keeping.keeperwire import KeeperKey, KeeperLink
    from lifecycle.runtime.keeping.weightpath import _attach  # the boot's own call

    prepare()
    key = KeeperKey.derived(payload["secret"].encode())
    link = KeeperLink(path=Path(payload["socket"]), key=key, named=True)
    # The rank's groups, which the skeleton names and the rank puts in their place.
    comm = SimpleNamespace(
        **{n: object() for n in ("world", "ulysses", "cfg", "staging", "pending")}
    )
    rank = cast(Any, SimpleNamespace(comm=comm, device=torch.device("cpu")))
    gc.collect()

    def work() -> dict[str, Any]:
        started = time.perf_counter()
        pipeline = _attach(rank, link, payload["key"])
        seconds = time.perf_counter() - started
        if pipeline is None:
            raise RuntimeError("the keeper does not hold the weights key")
        started = time.perf_counter()
        gc.collect()
        collect_s = time.perf_counter() - started
        return {"seconds": seconds, "collect_s": collect_s, "objects": len(gc.get_objects())}

    return work


@dataclass(frozen=True, slots=True, kw_only=True)
class Restarts:
    """Row 2's serves: the fill, then restarts with the keeper and with --keeper off, each after
    the SIGKILL of the serve before it."""

    fill: Started
    kept: tuple[Started, ...]
    off: tuple[Started, ...]


def measure_restarts(
    settings: Settings, directory: Directory, folder: Path, env: Mapping[str, str]
) -> Restarts:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "restarts.db"
    pairs = sizes(settings).restarts

    def options(keeper: str) -> tuple[str, ...]:
        return ("--model-path", str(directory.path), *DIRECTORY_OPTIONS, "--num-ranks", "2",
                "--keeper", keeper)  # fmt: skip

    with running_keeper(folder / "keeper", env) as keeper:
        socket = str(keeper.socket)
        progress("keeper: a 2-rank serve that loads and gives, then SIGKILLed")
        with serving("fill", options(socket), db=db, env=env, ranks=2) as (server, fill):
            fill.expect("gate-check", LOAD, "the first serve")
            if sorted(fill.kept) != ["held", "kept"]:
                raise BenchError(
                    f"the first serve's weights_kept: {fill.kept}, expected kept, held"
                )
            kill(server, fill)
        kept: list[Started] = []
        off: list[Started] = []
        for index in range(pairs):
            progress(f"keeper: 2-rank serve restarts, pair {index + 1}/{pairs}")
            sides = [(kept, socket, ATTACH), (off, OFF, LOAD)]
            for seen, which, path in sides if index % 2 == 0 else sides[::-1]:
                with serving(which, options(which), db=db, env=env, ranks=2) as (server, run):
                    run.expect("gate-check", path, f"a restart with --keeper {which}")
                    kill(server, run)
                seen.append(run)
    return Restarts(fill=fill, kept=tuple(kept), off=tuple(off))


@dataclass(frozen=True, slots=True, kw_only=True)
class Shared:
    """Row 3: four ranks attached, each one's Pss and Rss of the keeper's memfd at ready."""

    fill: Started
    runs: tuple[Started, ...]
    mapped: tuple[tuple[Mapped, ...], ...]  # per run, per rank
    held_bytes: int  # what the keeper holds (status)

    def summed(self, field: str) -> list[int]:
        """`field` summed over the ranks, per run."""
        return [sum(getattr(m, field) for m in run) for run in self.mapped]


def measure_shared(settings: Settings, folder: Path, env: Mapping[str, str]) -> Shared:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "shared.db"
    rounds = sizes(settings).rounds
    with running_keeper(folder / "keeper", env) as keeper:
        options = (*MICRO, *FOUR_RANKS, "--keeper", str(keeper.socket))
        progress("keeper: a 4-rank micro-video serve that loads and gives, then SIGKILLed")
        with serving("fill-4", options, db=db, env=env, ranks=4) as (server, fill):
            if sorted(fill.kept) != ["held", "held", "held", "kept"]:
                raise BenchError(f"the first 4-rank serve's weights_kept: {fill.kept}")
            kill(server, fill)
        runs, mapped = [], []
        for index in range(rounds):
            progress(f"keeper: 4 ranks attached, round {index + 1}/{rounds}")
            with serving("attached-4", options, db=db, env=env, ranks=4) as (server, run):
                run.expect("gate-check", ATTACH, "a 4-rank restart")
                mapped.append(tuple(mapped_by(pid) for pid in run.pids))
                held = keeper.status()["held"]
                kill(server, run)
            runs.append(run)
    return Shared(
        fill=fill, runs=tuple(runs), mapped=tuple(mapped),
        held_bytes=sum(int(h["bytes"]) for h in held),
    )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Woken:
    """Row 4: one serve's cold startup, and its wake after a sleep."""

    run: Started  # read after the wake
    slept_s: float
    woke_s: float


def measure_wakes(settings: Settings, folder: Path, env: Mapping[str, str]) -> list[Woken]:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "wake.db"
    rounds = sizes(settings).rounds
    progress("keeper: a micro-video boot that calibrates, so that the startups reuse its plan")
    command = [sys.executable, "-m", "lifecycle", "boot", *MICRO, "--keeper", OFF,
               "--log-level", "warning", "--db", str(db)]  # fmt: skip
    run_to_exit(command, cwd=folder, env=env, timeout_s=BOOT_TIMEOUT_S, ranks=1)
    woken = []
    for index in range(rounds):
        progress(f"keeper: cold startup, sleep and wake, round {index + 1}/{rounds}")
        # A keeper of its own each round: empty, so that the startup loads from disk.
        with running_keeper(folder / f"keeper-{index}", env) as keeper:
            options = (*MICRO, "--keeper", str(keeper.socket))
            with serving("wake", options, db=db, env=env, ranks=1) as (server, run):
                run.expect("gate-check", LOAD, "a cold startup")
                slept = post(server, "/sleep")
                woke = post(server, "/wake")
                if (slept.get("status"), woke.get("status")) != ("asleep", "ready"):
                    raise BenchError(f"sleep answered {slept}, wake {woke}")
        after = journaled(db, run.run_id, ranks=1)
        after.expect("waking", ATTACH, "a wake")
        woken.append(Woken(run=after, slept_s=slept["seconds"], woke_s=woke["seconds"]))
    return woken


if __name__ == "__main__":
    from bench.procs import serve

    serve(task)
