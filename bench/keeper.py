"""The host's keeper of finished weights (`lifecycle keeper`) against loading them from disk:
a startup that attaches to the keeper's copy against one that loads (`--keeper off`), a 2-rank
serve killed and started again, four local ranks' memory of one copy, a wake against a cold
start, and what holding an attached startup to its reference output costs.

Every boot, serve and keeper is a child process (`python -m lifecycle`), each row's keeper one
of its own with a key of the run's own (LIFECYCLE_ARTIFACT_KEY), stopped at the row's end. The
model directories are bench.loadside's (random weights written by WanPipeline.save_pretrained
in a worker process, as bench.parallelload writes them), sized to this machine's memory and
removed after.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from bench.bootrun import clean_env, run_ids, run_to_exit
from bench.loadside import BF16_BYTES, FP32_BYTES, PROCESS_BYTES, UMT5_XXL, WAN_1_3B
from bench.parallelload import MEMORY_MARGIN_BYTES as LOAD_MARGIN_BYTES
from bench.parallelload import _available_bytes, _in_worker, _warm
from bench.procs import Pool, stop_groups
from bench.serving import ServeProcess
from bench.stats import median, median_interval
from bench.suite import BenchError, Benchmark, Settings, progress
from bench.table import Row, format_ratio, format_seconds, missing_extra, ratio_at_most, verdict

if TYPE_CHECKING:
    from lifecycle.core.format.events import WeightsPath

ATTACH_TARGET = 0.05  # the attach's seconds / a cold load's
RESTART_TARGET = 0.4  # SGLang PR 40230: 0.35x at one rank
SHARED_TARGET = 1.3  # four ranks' summed Pss of the keeper's copy / one rank's weights
WAKE_TARGET = 0.2
VERIFY_TARGET = 0.02
KEY_VAR = "LIFECYCLE_ARTIFACT_KEY"
WAN_LAYERS = 30  # Wan 2.1 T2V 1.3B's transformer
ENCODER_LAYERS = 1
MAPPING_NAME = "lifecycle-weights"  # the keeper's memfd, as /proc/PID/smaps names its mappings
# The directory's options, boot and serve alike: float32 on CPU, and a small default request so
# that the fixed request (the bounded shape at min(2, steps) steps) stays cheap.
SHAPE, STEPS = "64x64x5", 1
DIRECTORY_OPTIONS = ("--dtype", "float32", "--device", "cpu", "--default-shape", SHAPE,
                     "--default-steps", str(STEPS), "--smoke-request", "off")  # fmt: skip
BOOT_OPTIONS = (*DIRECTORY_OPTIONS, "--warmup-mode", "none", "--log-level", "warning")
MICRO = ("--model", "micro-video", "--smoke-request", "off")
FOUR_RANKS = ("--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2")
BOOT_TIMEOUT_S = 900.0
SERVE_READY_S = 900.0
REST_TIMEOUT_S = 600.0  # a POST /sleep or /wake
KEEPER_READY_S = 60.0
WORKER = "bench.keeper"  # this module, as the worker that attaches alone
WORKER_TIMEOUT_S = 600.0
GONE_TIMEOUT_S = 30.0
# What the rest of the machine keeps: the parallel load's margin, and 2 GiB more for the other
# work of a shared machine, which a keeper's copy and a load's beside it leave little room for.
MEMORY_MARGIN_BYTES = LOAD_MARGIN_BYTES + 2 * 2**30
ATTACH, LOAD = "attach", "load"
OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class Sized:
    transformer_layers: int | None  # None: as many as fit this machine's memory
    vocab: int
    pairs: int  # row 1: attach and cold boots, alternated
    restarts: int  # row 2: keeper and --keeper off restarts, alternated
    rounds: int  # rows 3 and 4


def _sized(settings: Settings) -> Sized:
    if settings.quick:
        return Sized(transformer_layers=2, vocab=4096, pairs=1, restarts=1, rounds=1)
    return Sized(transformer_layers=None, vocab=4096, pairs=5, restarts=3, rounds=3)


# --- the model directory ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Counts:
    """Parameters of a directory: all but the transformer's layers, and one of those."""

    base: int
    per_layer: int


def _counts(vocab: int) -> Counts:
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


def _directory(
    settings: Settings, workdir: Path, name: str, *, copies: int, ranks: int,
    counts: Callable[[], Counts],
) -> Directory:  # fmt: skip
    """A directory written by bench.loadside's builder in a worker, its files read once so that
    loads find them in the page cache; sized so that `copies` float32 copies of it, its files and
    `ranks` rank processes fit this machine's available memory less a margin."""
    sized = _sized(settings)
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


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


# --- the keeper ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Keeper:
    proc: subprocess.Popen[bytes]
    socket: Path
    secret: str
    log: Path

    def status(self) -> dict[str, Any]:
        from lifecycle.runtime.keeping.keeperwire import KeeperKey, ask

        answer, fds = ask(self.socket, KeeperKey.derived(self.secret.encode()), {"op": "status"})
        for fd in fds:
            os.close(fd)
        return answer


@contextlib.contextmanager
def _keeper(folder: Path, env: Mapping[str, str]) -> Iterator[Keeper]:
    """`lifecycle keeper` on a socket in `folder` (its default budget: half the host's memory),
    answering; stopped (SIGTERM, then SIGKILL of its group) on the way out."""
    from lifecycle.runtime.keeping.keeperwire import KeeperUnavailable

    folder.mkdir(parents=True, exist_ok=True)
    sock, log = folder / "socket" / "keeper.sock", folder / "keeper.log"
    command = [sys.executable, "-m", "lifecycle", "keeper", "--socket", str(sock),
               "--db", str(folder / "keeper.db")]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command, cwd=folder, stdout=out, stderr=subprocess.STDOUT, env=dict(env),
            start_new_session=True,
        )  # fmt: skip
    keeper = Keeper(proc=proc, socket=sock, secret=env[KEY_VAR], log=log)
    try:
        deadline = time.monotonic() + KEEPER_READY_S
        while True:
            if proc.poll() is not None:
                raise BenchError(f"the keeper exited {proc.returncode}: {_tail(log)}")
            try:
                keeper.status()
                break
            except KeeperUnavailable:
                if time.monotonic() > deadline:
                    raise BenchError(
                        f"the keeper did not answer within {KEEPER_READY_S:.0f} s: {_tail(log)}"
                    ) from None
                time.sleep(0.1)
        yield keeper
    finally:
        stop_groups([proc], within_s=30.0)


def _tail(path: Path) -> str:
    text = path.read_text(errors="replace").strip() if path.exists() else ""
    return text.splitlines()[-1][:300] if text else "(no output)"


# --- a startup as its journal tells it -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Started:
    """One run's startup, and what followed it, from its journal."""

    run_id: str
    ready_s: float  # the run's creation (its launch) to the last rank's first ready
    weights: tuple[tuple[int, str, WeightsPath], ...]  # (rank, state, event), journal order
    kept: tuple[str, ...]  # each weights_kept outcome
    kept_s: tuple[float, ...]  # and its seconds (packing the copy, the keeper's answer)
    references: tuple[str, ...]  # each reference_output outcome
    rejected: int  # attach_rejected events
    actions: dict[tuple[str, str], tuple[float, ...]]  # (state, action): each rank's seconds
    requests: dict[tuple[str, str], float]  # (state, source): the slowest rank's total_s
    pids: tuple[int, ...]  # each rank's process, by rank

    def paths(self, state: str) -> list[WeightsPath]:
        return [event for _, at, event in self.weights if at == state]

    def expect(self, state: str, path: str, label: str) -> list[WeightsPath]:
        """The weights_path events of `state`, one per rank, each `path`; BenchError if not."""
        found = self.paths(state)
        if len(found) != len(self.pids) or any(e.path != path for e in found):
            said = "; ".join(f"{e.path} ({e.reason})" for e in found) or "none"
            raise BenchError(f"{label} (run {self.run_id}): expected {path} on every rank: {said}")
        if path == ATTACH and self.rejected:
            raise BenchError(f"{label} (run {self.run_id}): attached weights were rejected")
        return found

    def action(self, state: str, name: str, *, least: bool = False) -> float:
        """The slowest rank's seconds of action `name` in `state` (with `least`, the fastest
        rank's: where the ranks agree at its end, the others' include waiting for it)."""
        seconds = self.actions.get((state, name))
        if not seconds:
            raise BenchError(f"run {self.run_id} journaled no {name} action in {state}")
        return min(seconds) if least else max(seconds)


def _new_run(db: Path, before: set[str]) -> str:
    new = run_ids(db) - before
    if len(new) != 1:
        raise BenchError(f"expected one new run in {db}, found {len(new)}")
    return new.pop()


def _started(db: Path, run_id: str, *, ranks: int) -> Started:
    from lifecycle.core.format.events import (
        ActionFinished,
        AttachRejected,
        ReferenceOutput,
        RequestFinished,
        RequestStarted,
        RunStarted,
        WeightsKept,
        WeightsPath,
    )
    from lifecycle.core.format.fold import fold_run
    from lifecycle.store.journal import Journal

    with Journal.open_for_read(str(db)) as journal:
        (run,) = [r for r in journal.runs() if r.run_id == run_id]
        stored = list(journal.read(run_id=run_id))
    views = fold_run(stored)
    ready_at = [view.entered_at("ready") for view in views.values()]
    if len(views) != ranks or any(at is None for at in ready_at):
        raise BenchError(f"run {run_id}: not all of its {ranks} ranks reached ready")
    weights, kept, kept_s, references, rejected = [], [], [], [], 0
    actions: dict[tuple[str, str], tuple[float, ...]] = {}
    requests: dict[tuple[str, str], float] = {}
    sources: dict[tuple[int, str], tuple[str, str]] = {}
    pids: dict[int, int] = {}
    for s in stored:
        event = s.event
        if isinstance(event, WeightsPath):
            weights.append((s.rank, s.state, event))
        elif isinstance(event, WeightsKept):
            kept.append(event.outcome)
            kept_s.append(event.seconds)
        elif isinstance(event, ReferenceOutput):
            references.append(event.outcome)
        elif isinstance(event, AttachRejected):
            rejected += 1
        elif isinstance(event, ActionFinished):
            key = (s.state, event.action)
            actions[key] = (*actions.get(key, ()), event.duration_s)
        elif isinstance(event, RequestStarted):
            sources[(s.rank, event.request_id)] = (s.state, event.source)
        elif isinstance(event, RequestFinished) and (s.rank, event.request_id) in sources:
            key = sources[(s.rank, event.request_id)]
            requests[key] = max(requests.get(key, 0.0), event.total_s)
        elif isinstance(event, RunStarted):
            pids[s.rank] = event.pid
    return Started(
        run_id=run_id,
        ready_s=max(at for at in ready_at if at is not None) - run.created_at,
        weights=tuple(weights), kept=tuple(kept), kept_s=tuple(kept_s),
        references=tuple(references), rejected=rejected, actions=actions, requests=requests,
        pids=tuple(pids[rank] for rank in sorted(pids)),
    )  # fmt: skip


def _boot(directory: Directory, keeper: str, *, db: Path, env: Mapping[str, str]) -> Started:
    """`lifecycle boot --model-path DIR BOOT_OPTIONS --keeper KEEPER` to its exit."""
    before = run_ids(db)
    command = [sys.executable, "-m", "lifecycle", "boot", "--model-path", str(directory.path),
               *BOOT_OPTIONS, "--keeper", keeper, "--db", str(db)]  # fmt: skip
    run_to_exit(command, cwd=db.parent, env=env, timeout_s=BOOT_TIMEOUT_S, ranks=1)
    return _started(db, _new_run(db, before), ranks=1)


# --- serving ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _serving(
    label: str, options: Sequence[str], *, db: Path, env: Mapping[str, str], ranks: int
) -> Iterator[tuple[ServeProcess, Started]]:
    """`lifecycle serve OPTIONS` ready (/health 200), with its startup read from the journal;
    SIGTERMed on the way out if it still runs (its group SIGKILLed after a minute)."""
    before = run_ids(db)
    server = ServeProcess(
        label=label, options=options, db=db, cwd=db.parent, env=env,
        ready_within=SERVE_READY_S, request_timeout_s=REST_TIMEOUT_S,
    )  # fmt: skip
    with server:
        yield server, _started(db, _new_run(db, before), ranks=ranks)


def _killed(server: ServeProcess, started: Started) -> None:
    """SIGKILL the server's process group (its ranks with it), then wait until every rank is
    gone, reaping the ranks that this run adopted (bench.reaper)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=GONE_TIMEOUT_S)
    deadline = time.monotonic() + GONE_TIMEOUT_S
    for pid in started.pids:
        while _alive(pid):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if time.monotonic() > deadline:
                raise BenchError(f"rank process {pid} still runs {GONE_TIMEOUT_S:.0f} s after kill")
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not: it holds no memory)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text.rpartition(")")[2].split()[0] != "Z"


def _post(server: ServeProcess, path: str) -> dict[str, Any]:
    request = urllib.request.Request(f"{server.url}{path}", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=REST_TIMEOUT_S) as response:
            answer: dict[str, Any] = json.loads(response.read())
    except OSError as exc:  # HTTPError included
        raise BenchError(f"POST {path} failed: {exc}: {server.tail()}") from None
    return answer


@dataclass(frozen=True, slots=True, kw_only=True)
class Mapped:
    """One process's mappings of the keeper's memfd, in bytes (/proc/PID/smaps)."""

    pss: int  # its share of their resident pages (a page N processes map counts 1/N)
    rss: int  # their resident pages, whoever else maps them
    anonymous: int  # pages of its own in them: copied on write


SMAPS_FIELDS = {"Pss:": "pss", "Rss:": "rss", "Anonymous:": "anonymous"}


def _mapped(pid: int) -> Mapped:
    """What process `pid`'s mappings whose name holds MAPPING_NAME (the keeper's memfd)
    hold, summed over them."""
    found = dict.fromkeys(SMAPS_FIELDS.values(), 0)
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = MAPPING_NAME in line
        elif inside and (field := SMAPS_FIELDS.get(line.split(maxsplit=1)[0])):
            found[field] += int(line.split()[1]) * 1024
    return Mapped(**found)


# --- the measures ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Boots:
    """Row 1's boots: the fill, then the attached and cold ones, pair by pair."""

    fill: Started
    attached: tuple[Started, ...]
    cold: tuple[Started, ...]
    alone: tuple[dict[str, Any], ...]  # the attach alone, in a worker (task)


def _boots(settings: Settings, directory: Directory, folder: Path, env: Mapping[str, str]) -> Boots:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "boots.db"
    pairs = _sized(settings).pairs
    with _keeper(folder / "keeper", env) as keeper:
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


def _restarts(
    settings: Settings, directory: Directory, folder: Path, env: Mapping[str, str]
) -> Restarts:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "restarts.db"
    pairs = _sized(settings).restarts

    def options(keeper: str) -> tuple[str, ...]:
        return ("--model-path", str(directory.path), *DIRECTORY_OPTIONS, "--num-ranks", "2",
                "--keeper", keeper)  # fmt: skip

    with _keeper(folder / "keeper", env) as keeper:
        socket = str(keeper.socket)
        progress("keeper: a 2-rank serve that loads and gives, then SIGKILLed")
        with _serving("fill", options(socket), db=db, env=env, ranks=2) as (server, fill):
            fill.expect("gate-check", LOAD, "the first serve")
            if sorted(fill.kept) != ["held", "kept"]:
                raise BenchError(
                    f"the first serve's weights_kept: {fill.kept}, expected kept, held"
                )
            _killed(server, fill)
        kept: list[Started] = []
        off: list[Started] = []
        for index in range(pairs):
            progress(f"keeper: 2-rank serve restarts, pair {index + 1}/{pairs}")
            sides = [(kept, socket, ATTACH), (off, OFF, LOAD)]
            for seen, which, path in sides if index % 2 == 0 else sides[::-1]:
                with _serving(which, options(which), db=db, env=env, ranks=2) as (server, run):
                    run.expect("gate-check", path, f"a restart with --keeper {which}")
                    _killed(server, run)
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


def _shared(settings: Settings, folder: Path, env: Mapping[str, str]) -> Shared:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "shared.db"
    rounds = _sized(settings).rounds
    with _keeper(folder / "keeper", env) as keeper:
        options = (*MICRO, *FOUR_RANKS, "--keeper", str(keeper.socket))
        progress("keeper: a 4-rank micro-video serve that loads and gives, then SIGKILLed")
        with _serving("fill-4", options, db=db, env=env, ranks=4) as (server, fill):
            if sorted(fill.kept) != ["held", "held", "held", "kept"]:
                raise BenchError(f"the first 4-rank serve's weights_kept: {fill.kept}")
            _killed(server, fill)
        runs, mapped = [], []
        for index in range(rounds):
            progress(f"keeper: 4 ranks attached, round {index + 1}/{rounds}")
            with _serving("attached-4", options, db=db, env=env, ranks=4) as (server, run):
                run.expect("gate-check", ATTACH, "a 4-rank restart")
                mapped.append(tuple(_mapped(pid) for pid in run.pids))
                held = keeper.status()["held"]
                _killed(server, run)
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


def _wakes(settings: Settings, folder: Path, env: Mapping[str, str]) -> list[Woken]:
    folder.mkdir(parents=True, exist_ok=True)
    db = folder / "wake.db"
    rounds = _sized(settings).rounds
    progress("keeper: a micro-video boot that calibrates, so that the startups reuse its plan")
    command = [sys.executable, "-m", "lifecycle", "boot", *MICRO, "--keeper", OFF,
               "--log-level", "warning", "--db", str(db)]  # fmt: skip
    run_to_exit(command, cwd=folder, env=env, timeout_s=BOOT_TIMEOUT_S, ranks=1)
    woken = []
    for index in range(rounds):
        progress(f"keeper: cold startup, sleep and wake, round {index + 1}/{rounds}")
        # A keeper of its own each round: empty, so that the startup loads from disk.
        with _keeper(folder / f"keeper-{index}", env) as keeper:
            options = (*MICRO, "--keeper", str(keeper.socket))
            with _serving("wake", options, db=db, env=env, ranks=1) as (server, run):
                run.expect("gate-check", LOAD, "a cold startup")
                slept = _post(server, "/sleep")
                woke = _post(server, "/wake")
                if (slept.get("status"), woke.get("status")) != ("asleep", "ready"):
                    raise BenchError(f"sleep answered {slept}, wake {woke}")
        after = _started(db, run.run_id, ranks=1)
        after.expect("waking", ATTACH, "a wake")
        woken.append(Woken(run=after, slept_s=slept["seconds"], woke_s=woke["seconds"]))
    return woken


def measure(settings: Settings) -> list[Row]:
    env = clean_env({KEY_VAR: secrets.token_hex(32)})  # the keeper's and the ranks' key
    try:
        import diffusers  # noqa: F401
    except ImportError:
        missing = True
    else:
        missing = False
    with tempfile.TemporaryDirectory(prefix="keeper-", dir=settings.workdir) as scratch:
        work = Path(scratch)
        directory_rows = None if missing else _directory_rows(settings, work, env)
        shared = _shared(settings, work / "shared", env)
        woken = _wakes(settings, work / "wake", env)
    if directory_rows is None:
        return [
            missing_extra("keeper: attach against a cold load: not run", extra="diffusers"),
            missing_extra("keeper: restarted 2-rank serve: not run", extra="diffusers"),
            _shared_row(shared),
            _wake_row(woken),
            missing_extra("keeper: the verification's cost: not run", extra="diffusers"),
        ]
    attach, restart, verify, verify_warm = directory_rows
    return [attach, restart, _shared_row(shared), _wake_row(woken), verify, verify_warm]


def _directory_rows(
    settings: Settings, work: Path, env: Mapping[str, str]
) -> tuple[Row, Row, Row, Row]:
    """Rows 1, 2 and the verification's two: each directory written, measured and removed."""
    found: list[Counts] = []

    def counts() -> Counts:
        if not found:
            found.append(_counts(_sized(settings).vocab))
        return found[0]

    one = _directory(settings, work, "wan-boots", copies=2, ranks=1, counts=counts)
    fixed = _sized(settings).transformer_layers is not None  # --quick: one directory for both
    try:
        boots = _boots(settings, one, work / "boots", env)
    finally:
        if not fixed:
            shutil.rmtree(one.path, ignore_errors=True)
    # Two ranks that each load and pack a copy while the keeper is filled: four copies.
    two = one if fixed else _directory(settings, work, "wan-restarts", copies=4, ranks=2,
                                       counts=counts)  # fmt: skip
    try:
        restarts = _restarts(settings, two, work / "restarts", env)
    finally:
        shutil.rmtree(two.path, ignore_errors=True)
    return (
        _attach_row(one, boots),
        _restart_row(two, one, restarts),
        _verify_row(boots),
        _verify_warm_row(restarts),
    )


# --- the rows --------------------------------------------------------------------------------


def _interval(ratios: Sequence[float]) -> str:
    found = median_interval(ratios)
    return (
        f"[{format_ratio(found.low)}, {format_ratio(found.high)}] with {found.coverage:.1%}"
        " confidence (sign test)"
    )


def _seconds_each(values: Sequence[float]) -> str:
    return ", ".join(format_seconds(v) for v in values)


def _weights_s(run: Started) -> float:
    return max(e.seconds for e in run.paths("gate-check"))


def _attach_row(directory: Directory, boots: Boots) -> Row:
    a = [_weights_s(b) for b in boots.attached]
    b = [_weights_s(b) for b in boots.cold]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    nbytes = boots.attached[0].paths("gate-check")[0].bytes
    kept = boots.fill.kept
    give_s = median([e.seconds for e in boots.fill.paths("gate-check")])
    ready_a = [x.ready_s for x in boots.attached]
    ready_b = [x.ready_s for x in boots.cold]
    c = [x["seconds"] for x in boots.alone]
    floor = median([x / y for x, y in zip(c, b, strict=True)])
    ratio = median(ratios)
    target = verdict(f"<= {ATTACH_TARGET:g}", met=ratio <= ATTACH_TARGET)
    return Row(
        figure="keeper: attach against a cold load (Wan-1.3B-sized directory, float32 on CPU)",
        value=format_seconds(median(a)),
        baseline=f"{format_seconds(median(b))} load, --keeper off",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor)}: "
        + ("reachable" if floor <= ATTACH_TARGET else "NOT reachable"),
        how=(
            f"{directory.text()}. `lifecycle boot --model-path DIR {' '.join(BOOT_OPTIONS)}`, one"
            " rank, journal shared by every boot; a keeper of its own (`lifecycle keeper`,"
            " default budget), filled once by a boot that loaded"
            f" ({format_seconds(give_s)}) and gave its weights (weights_kept: {kept[0]}, in"
            f" {format_seconds(boots.fill.kept_s[0])}: the copy into the memfd and the"
            " keeper's answer); then"
            f" {len(a)} round(s), the order of the sides rotating: A `--keeper PATH` (attached,"
            " reference_output matched), B `--keeper off` (loaded), C the floor. Value and"
            " baseline: the"
            " weights_path event's seconds (A: the keeper's answer, the skeleton's signature"
            " checked, unpickled onto the mapped memfd; B: the pipeline built and read from"
            f" the page cache), medians; {_mib(nbytes)} of weights either way; the ratio is the"
            f" median of the paired ratios, in {_interval(ratios)}. Each: A"
            f" {_seconds_each(a)}; B {_seconds_each(b)}. Startup to ready (launch to ready):"
            f" A {format_seconds(median(ready_a))} (its verification included, below), B"
            f" {format_seconds(median(ready_b))}. C, the floor: the same attach alone, by the"
            " boot's own call (weightpath._attach), in a fresh process that imported what a"
            " boot's load imports and collected its garbage before the clock:"
            f" {_seconds_each(c)} (paired ratio to B, median); a full garbage collection of that"
            f" process's {median([x['objects'] for x in boots.alone]):,.0f} objects right after"
            f" took {format_seconds(median([x['collect_s'] for x in boots.alone]))}: A less C is"
            " what the boot's attach pays beyond the unpickling and the keeper's answer (a"
            " collection that the unpickling's allocations set off, in a boot's larger heap)"
        ),
    )


def _restart_row(directory: Directory, first: Directory, restarts: Restarts) -> Row:
    a = [r.ready_s for r in restarts.kept]
    b = [r.ready_s for r in restarts.off]
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    # No attach can take less than nothing: B less its load is what a restart keeps paying.
    floor = [(r.ready_s - _weights_s(r)) / r.ready_s for r in restarts.off]
    floor_ratio = median(floor)
    if directory.path == first.path:
        size = "the same directory as above"
    elif directory.layers == first.layers:
        size = "a directory of the same size as above, written again"
    else:
        size = f"a smaller directory written the same way ({directory.text()})"
    ratio = median(ratios)
    target = verdict(f"<= {RESTART_TARGET:g}", met=ratio <= RESTART_TARGET)
    warm_a = [r.action("bounded-warm", "bounded-warmup") for r in restarts.kept]
    warm_b = [r.action("bounded-warm", "bounded-warmup") for r in restarts.off]
    load_b = [_weights_s(r) for r in restarts.off]
    attach_a = [_weights_s(r) for r in restarts.kept]
    return Row(
        figure="keeper: restarted 2-rank serve, startup to ready",
        value=format_seconds(median(a)),
        baseline=f"{format_seconds(median(b))} --keeper off",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor_ratio)}: "
        + ("reachable" if floor_ratio <= RESTART_TARGET else "NOT reachable"),
        how=(
            f"`lifecycle serve --model-path DIR {' '.join(DIRECTORY_OPTIONS)} --num-ranks 2`"
            f" (ulysses 2, the default bounded warmup), {size}; a keeper of its own, filled by a"
            " first serve (weights_kept: "
            + ", ".join(
                f"{o} in {format_seconds(t)}"
                for o, t in zip(restarts.fill.kept, restarts.fill.kept_s, strict=True)
            )
            + ": one rank's copy kept, the other's held already, each packed first),"
            " SIGKILLed with its process group; then"
            f" {len(a)} pair(s) of restarts alternated, each started after the SIGKILL of the"
            " serve before it: A `--keeper PATH` (every rank attached), B `--keeper off`"
            " (every rank loaded). Startup to ready: the run's creation (the serve's launch)"
            " to the last rank entering ready, from the journal, medians; paired ratio in"
            f" {_interval(ratios)}; each: A {_seconds_each(a)}, B {_seconds_each(b)}. Weights:"
            f" A attached in {format_seconds(median(attach_a))}, B loaded in"
            f" {format_seconds(median(load_b))}; the bounded warmup's request, A on attached"
            f" weights {format_seconds(median(warm_a))}, B on loaded ones"
            f" {format_seconds(median(warm_b))}. Floor: B less its load, over B (what a"
            " restart that took no time for its weights would still pay: the launch and"
            " imports, the warmup), median of the restarts"
        ),
    )


def _verify_row(boots: Boots) -> Row:
    verify = [b.action("bounded-warm", "verify-weights") for b in boots.attached]
    ready = [b.ready_s for b in boots.cold]
    ratios = [x / y for x, y in zip(verify, ready, strict=True)]
    request = [b.requests.get(("bounded-warm", "verify"), 0.0) for b in boots.attached]
    floor = median([x / y for x, y in zip(request, ready, strict=True)])
    ratio = median(ratios)
    target = verdict(f"<= {VERIFY_TARGET:.0%}", met=ratio <= VERIFY_TARGET)
    return Row(
        figure="keeper: the verification's cost, attached boot without warmup",
        value=format_seconds(median(verify)),
        baseline=f"{format_seconds(median(ready))} cold startup to ready",
        ratio=f"{ratio:.1%}",
        target=f"{target}; floor {floor:.1%}: "
        + ("reachable" if floor <= VERIFY_TARGET else "NOT reachable"),
        how=(
            "the boots of the attach row (`--warmup-mode none`): the verify-weights action's"
            " duration_s (action_finished, state bounded-warm) in each attached boot, over the"
            " startup to ready of the cold boot (`--keeper off`) of its pair, which verifies"
            " nothing (no keeper, no warmup); median of the paired ratios, in"
            f" {_interval(ratios)}. With no warmup to reuse, the verification runs the fixed"
            f" request itself ({SHAPE} at {STEPS} step, prompt and negative prompt through the"
            " UMT5-wide encoder, the VAE's decode): that request's request_finished total_s,"
            f" {format_seconds(median(request))}, is the floor no verification that runs it can"
            " go under; reference_output of each attached boot: "
            + ", ".join(sorted({o for b in boots.attached for o in b.references}))
        ),
    )


def _verify_warm_row(restarts: Restarts) -> Row:
    verify = [r.action("bounded-warm", "verify-weights", least=True) for r in restarts.kept]
    waited = [r.action("bounded-warm", "verify-weights") for r in restarts.kept]
    off = [r.action("bounded-warm", "verify-weights", least=True) for r in restarts.off]
    ready = [r.ready_s for r in restarts.off]
    ratios = [x / y for x, y in zip(verify, ready, strict=True)]
    ratio = median(ratios)
    return Row(
        figure="keeper: the verification's cost, attached 2-rank serve after its warmup",
        value=format_seconds(median(verify)),
        baseline=f"{format_seconds(median(ready))} --keeper off restart to ready",
        ratio=f"{ratio:.2%}",
        target=verdict(f"<= {VERIFY_TARGET:.0%}", met=ratio <= VERIFY_TARGET),
        how=(
            "the restarts of the 2-rank serve row (the default bounded warmup, whose request is"
            " the fixed one): the verify-weights action's duration_s in each attached restart"
            " (the warmup's output held to the reference, the ranks agreeing by two all_reduces;"
            " no request of its own), the fastest rank's: the other's includes waiting there"
            f" for the slower warmup ({format_seconds(median(waited))}, median), over the startup"
            " to ready of the --keeper off restart of its pair; median of the paired ratios, in"
            f" {_interval(ratios)}; reference_output: "
            + ", ".join(sorted({o for r in restarts.kept for o in r.references}))
            + "; the --keeper off restarts hold their warmup's output to the reference too"
            f" (verify-weights {format_seconds(median(off))}, fastest rank)"
        ),
    )


def _shared_row(shared: Shared) -> Row:
    summed = shared.summed("pss")
    one = shared.runs[0].paths("gate-check")[0].bytes
    ratio = median(summed) / one
    last = shared.mapped[-1]
    once = median(
        [sum(m.pss for m in run) / max(1, *(m.rss for m in run)) for run in shared.mapped]
    )
    return Row(
        figure="keeper: 4 local ranks hold the weights once",
        value=f"{_mib(median(summed))} summed Pss",
        baseline=f"{_mib(4 * one)} in 4 private copies (4 x {_mib(one)})",
        **ratio_at_most(ratio, SHARED_TARGET, spec="g"),
        how=(
            f"`lifecycle serve {' '.join(MICRO)} {' '.join(FOUR_RANKS)} --keeper PATH`, a"
            " keeper of its own filled by a first serve (weights_kept: "
            + ", ".join(sorted(shared.fill.kept))
            + ": one rank's copy kept, the others held already and served with their own),"
            f" SIGKILLed with its group; then {len(summed)} restart(s), every rank attached; at"
            " /health 200, each rank process's (pids from run_started) Pss of its mappings of"
            f" the keeper's memfd (/proc/PID/smaps, mappings named {MAPPING_NAME}), summed over"
            " the 4 ranks, median over the restarts; the ratio is that over one rank's weights"
            " (its weights_path bytes). Pss counts only the pages a rank has touched by ready:"
            " per rank Pss "
            + ", ".join(_mib(m.pss) for m in last)
            + ", Rss "
            + ", ".join(_mib(m.rss) for m in last)
            + f" of the {_mib(one)} each maps (the rest, never read before ready, is resident in"
            " the memfd alone); pages copied on write in those mappings (Anonymous), summed:"
            f" {_mib(median(shared.summed('anonymous')))}; summed Pss over the most any rank"
            f" has resident (1: every page touched held once; 4: a copy each):"
            f" {format_ratio(once)}; the keeper holds"
            f" {_mib(shared.held_bytes)} (skeleton and blob, all written when given, in shared"
            " memory whether mapped or not): what the host spends on these 4 ranks' weights is"
            " that and the pages copied on write. Baseline: not measured, what 4 ranks with"
            " --keeper off hold in private copies, 4 x the weights_path bytes (a rank's"
            " anonymous memory does not tell its weights from the rest)"
        ),
    )


def _wake_row(woken: Sequence[Woken]) -> Row:
    wake = [w.woke_s for w in woken]
    ready = [w.run.ready_s for w in woken]
    ratios = [x / y for x, y in zip(wake, ready, strict=True)]
    request = [w.run.requests.get(("waking", "verify"), 0.0) for w in woken]
    floor = median([x / y for x, y in zip(request, ready, strict=True)])
    ratio = median(ratios)
    action = [w.run.action("waking", "wake-weights") for w in woken]
    attach = [max(e.seconds for e in w.run.paths("waking")) for w in woken]
    target = verdict(f"<= {WAKE_TARGET:g}", met=ratio <= WAKE_TARGET)
    return Row(
        figure="keeper: wake to ready against a cold start",
        value=format_seconds(median(wake)),
        baseline=f"{format_seconds(median(ready))} cold startup to ready",
        ratio=format_ratio(ratio),
        target=f"{target}; floor {format_ratio(floor)}: "
        + ("reachable" if floor <= WAKE_TARGET else "NOT reachable"),
        how=(
            f"`lifecycle serve {' '.join(MICRO)} --keeper PATH`, one rank, a fresh keeper each"
            " round so that its startup loads from disk (and gives); the journal holds a"
            " verified residency plan from an earlier boot, so the startup takes the bounded"
            " path as a restart does. At ready, POST /sleep"
            f" ({format_seconds(median([w.slept_s for w in woken]))}), then POST /wake: value"
            " its answer's seconds; baseline the same run's startup to ready (launch to ready,"
            f" from the journal); {len(wake)} round(s), median of the paired ratios. The wake:"
            f" weights attached in {format_seconds(median(attach))}, the wake-weights action"
            f" {format_seconds(median(action))}, of which the fixed request run to verify them"
            f" {format_seconds(median(request))}: the floor, a wake verifies whatever it"
            " attached by running that request"
        ),
    )


BENCHMARK = Benchmark(name="keeper", measure=measure)


if __name__ == "__main__":
    from bench.procs import serve

    serve(task)
