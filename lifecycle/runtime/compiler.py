"""`--compile`: the denoiser's repeated block compiled once per fingerprint. A rank compiles in
a compiler cache folder of its own, first filled from the artifact the journal keeps for the
compile key (so that a pod on a fresh machine compiles from what another pod compiled); after
the warmups rank 0 keeps what the folder holds, when it holds more than was loaded. See the
README's "Compile and shapes, paid once per fingerprint"."""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import platform
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import structlog
import torch

from lifecycle.core.decisions.compiling import (
    MAX_ARTIFACT_BYTES,
    CacheUse,
    CompileKey,
    stale_reason,
)
from lifecycle.core.decisions.warmupplan import bounded_shape
from lifecycle.core.errors import JournalError
from lifecycle.core.format.events import Compiled, CompileKept
from lifecycle.core.format.records import Generation
from lifecycle.runtime.group.comm import run_eagerly_under_compile
from lifecycle.runtime.group.signals import before_leaving
from lifecycle.runtime.pipeline import repeated_blocks
from lifecycle.runtime.rankruntime import RankRuntime
from lifecycle.runtime.request import run_request
from lifecycle.store.backends.dberrors import DATABASE_ERRORS
from lifecycle.store.learned.artifacts import ArtifactUnusable

log = structlog.get_logger("lifecycle.runtime")

BACKEND = "inductor"
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
TRITON_ENV = "TRITON_CACHE_DIR"
NO_BLOCKS = "the pipeline declares no repeated blocks (repeated_blocks): it runs eager"
# A journal that cannot be read or written costs the cache, never the startup.
_JOURNAL_ERRORS: tuple[type[Exception], ...] = (JournalError, *DATABASE_ERRORS)
# What the compile runs to compile: one denoising step at the bounded shape (the blocks see the
# shapes the bounded warmup will; other shapes compile when first run, and are kept with them).
COMPILE_STEPS = 1


def machine() -> str:
    """What compiled code depends on beside torch: the CPU's architecture, and the
    accelerator's name and capability where there is one."""
    name = platform.machine() or "unknown"
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name += f" {torch.cuda.get_device_name(index)} sm_{major}{minor} cuda {torch.version.cuda}"
    return name[:255]


def compile_key(rt: RankRuntime) -> CompileKey:
    assert rt.fingerprint is not None, "decide-path fingerprints the startup first"
    return CompileKey(
        fingerprint=rt.fingerprint.key,
        model=rt.args.model.name,
        torch=torch.__version__,
        python=platform.python_version(),
        machine=machine(),
        backend=BACKEND,
        mode=rt.args.compile_mode,
    )


def compile_denoiser(rt: RankRuntime) -> None:
    """The `compile` action (gate-check, with --compile): load the key's artifact, compile the
    repeated blocks and run them once; journal what the cache did and how long it all took."""
    args = rt.args
    assert rt.pipeline is not None
    blocks = repeated_blocks(rt.pipeline)
    if blocks is None:
        rt.recorder.record(
            Compiled(
                key=None,
                blocks=0,
                backend=BACKEND,
                mode=args.compile_mode,
                seconds=0.0,
                cache=CacheUse.OFF.value,
                reason=NO_BLOCKS,
                artifact_bytes=0,
            )
        )
        return
    key = rt.compile_key = compile_key(rt)
    folder = rt.compile_folder = _private_cache_folder()
    started = time.perf_counter()
    cache, reason, loaded = _load_artifact(rt, key, folder)
    rt.compile_cache = cache
    rt.compile_files = _files(folder)
    run_eagerly_under_compile()
    for block in blocks:
        block.compile(backend=BACKEND, mode=args.compile_mode)
    shape = bounded_shape(args.model)
    run_request(
        rt.pipeline,
        Generation(
            prompt="compile",
            shape=shape,
            steps=COMPILE_STEPS,
            guidance_scale=args.model.default_guidance_scale,
            seed=args.seed,
        ),
        meter=rt.meter,
        device=rt.device,
        decode=False,
    )
    rt.recorder.record(
        Compiled(
            key=key.key,
            blocks=len(blocks),
            backend=BACKEND,
            mode=args.compile_mode,
            seconds=time.perf_counter() - started,
            cache=cache.value,
            reason=reason,
            artifact_bytes=loaded,
        )
    )


def _private_cache_folder() -> Path:
    """A compiler cache folder of this process's own, used from now on: what it holds after
    the compile is what this startup compiled (or loaded), and nothing another process wrote."""
    folder = Path(tempfile.mkdtemp(prefix="lifecycle-compile-"))
    os.environ[CACHE_ENV] = str(folder)
    os.environ[TRITON_ENV] = str(folder / "triton")
    remove = lambda: shutil.rmtree(folder, ignore_errors=True)  # noqa: E731
    before_leaving(remove)  # a process that ends through leave_process
    atexit.register(remove)  # and one that returns
    return folder


def _load_artifact(
    rt: RankRuntime, key: CompileKey, folder: Path
) -> tuple[CacheUse, str | None, int]:
    """Fill `folder` from the journal's artifact of `key`: what the cache did, why, and the
    bytes loaded. An artifact that is stale, corrupt or unreadable is never unpacked."""
    try:
        store = rt.recorder.artifacts()
        found = store.candidates(key.model)
    except _JOURNAL_ERRORS as exc:
        return CacheUse.MISS, f"the journal's artifacts could not be read: {exc}", 0
    exact = next((a for a in found if a.key == key.key), None)
    if exact is None:
        if not found:
            return CacheUse.MISS, None, 0
        newest = found[0]
        why = f"the journal's artifact of {key.model} is not this key's: "
        return CacheUse.REJECTED, why + stale_reason(key, newest.compile_key), 0
    if exact.compile_key != key:  # a row under this key that says it was compiled otherwise
        rt.compile_replaces = True
        why = "the artifact of this key is not used: "
        return CacheUse.REJECTED, why + stale_reason(key, exact.compile_key), 0
    try:
        data = store.read(exact)
        _unpack(data, folder)
    except ArtifactUnusable as exc:
        rt.compile_replaces = True  # kept anew, in its place, after the compile
        return CacheUse.REJECTED, f"the artifact of this key is not used: {exc}", 0
    except _JOURNAL_ERRORS as exc:
        return CacheUse.MISS, f"the artifact could not be read: {exc}", 0
    with contextlib.suppress(*_JOURNAL_ERRORS):
        store.mark_used(exact.key, run_id=rt.recorder.run_id)
    rt.compile_replaces = True  # what compiles past it is kept with it, in its place
    return CacheUse.HIT, None, len(data)


def _unpack(data: bytes, folder: Path) -> None:
    """Unpack an artifact into `folder`: regular files and folders only, inside it (the data
    filter refuses links, devices and paths that leave it); ArtifactUnusable otherwise."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.extractall(folder, filter="data")
    except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True, exist_ok=True)
        raise ArtifactUnusable(f"it does not unpack: {exc}") from None


def _files(folder: Path) -> frozenset[tuple[str, int]]:
    """The folder's files (path and size): what it holds, to tell whether compiling added to
    what was loaded. Lock files come and go and say nothing."""
    return frozenset(
        (str(path.relative_to(folder)), path.stat().st_size)
        for path in folder.rglob("*")
        if path.is_file() and not path.name.endswith(".lock")
    )


def _pack(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.name.endswith(".lock"):
                archive.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


def keep_compiled(rt: RankRuntime) -> None:
    """The `keep-compiled` action (ready, with --compile): rank 0 keeps what its compiler cache
    holds in the journal, when the compile did not load it all (a miss, a rejection, or shapes
    compiled after a hit); any failure to keep it is journaled and the startup goes on."""
    key, folder = rt.compile_key, rt.compile_folder
    if key is None or folder is None or rt.layout.rank != 0:
        return
    if rt.compile_cache is CacheUse.HIT and _files(folder) == rt.compile_files:
        return  # everything compiled came from the artifact loaded
    data = _pack(folder)
    if len(data) > MAX_ARTIFACT_BYTES:
        why: str | None = (
            f"{len(data):,} bytes is more than the {MAX_ARTIFACT_BYTES:,} kept at most"
        )
    else:
        try:
            why = rt.recorder.artifacts().keep(
                key, data, run_id=rt.recorder.run_id, replace=rt.compile_replaces
            )
        except _JOURNAL_ERRORS as exc:
            why = f"the journal could not be written: {exc}"
    rt.recorder.record(CompileKept(key=key.key, bytes=len(data), kept=why is None, reason=why))
