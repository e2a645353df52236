"""`--compile`: the denoiser's repeated block compiled once per fingerprint. A rank compiles in
compiler folders of its own, its cache first filled from the artifact the journal keeps for the
compile key when the operator's key signed it (so that a pod on a fresh machine compiles from
what another pod compiled); after the warmups rank 0 keeps what the cache holds, signed, when it
holds more than was loaded. See docs/compile.md."""

from __future__ import annotations

import hashlib
import os
import platform
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from lifecycle.core.decisions.compiling import (
    MAX_ARTIFACT_BYTES,
    CacheUse,
    CompileKey,
)
from lifecycle.core.decisions.warmupplan import bounded_shape
from lifecycle.core.errors import ConfigError
from lifecycle.core.format.events import Compiled, CompileKept
from lifecycle.core.format.records import Generation
from lifecycle.runtime.artifacts.archive import pack
from lifecycle.runtime.artifacts.cacheload import (
    JOURNAL_ERRORS,
    load_artifact,
    private_compiler_folders,
    use_cache_folder,
)
from lifecycle.runtime.artifacts.signing import artifact_key
from lifecycle.runtime.group.comm import run_eagerly_under_compile
from lifecycle.runtime.pipeline import Pipeline
from lifecycle.runtime.rankruntime import RankRuntime
from lifecycle.runtime.request import run_request

BACKEND = "inductor"
NO_BLOCKS = "the pipeline declares no repeated blocks (repeated_blocks): it runs eager"
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


def declared_blocks(pipeline: Pipeline) -> tuple[tuple[torch.nn.Module, ...] | None, str]:
    """The pipeline's repeated blocks, or None and why not in words: it declares none, or
    what it returned is not blocks (a plug-in's mistake, said as such)."""
    declared = getattr(pipeline, "repeated_blocks", None)
    if not callable(declared):
        return None, NO_BLOCKS
    returned = declared()
    if not isinstance(returned, Iterable) or isinstance(returned, str | bytes):
        kind = type(returned).__name__
        return None, f"repeated_blocks() returned a {kind}, not torch modules: it runs eager"
    blocks = tuple(returned)
    if not blocks:
        return None, "repeated_blocks() returned no blocks: it runs eager"
    others = [block for block in blocks if not isinstance(block, torch.nn.Module)]
    if others:
        return None, (
            f"repeated_blocks() returned {len(others)} of {len(blocks)} that are not torch"
            f" modules (the first a {type(others[0]).__name__}): it runs eager"
        )
    return blocks, ""


def compile_denoiser(rt: RankRuntime) -> None:
    """The `compile` action (gate-check, with --compile): load the key's artifact when the
    operator's key signed it, compile the repeated blocks and run them once; journal what the
    cache did and how long it all took. A key that cannot be used refuses the startup."""
    args = rt.args
    assert rt.pipeline is not None
    blocks, why_not = declared_blocks(rt.pipeline)
    if blocks is None:
        rt.recorder.record(
            Compiled(
                key=None,
                blocks=0,
                backend=BACKEND,
                mode=args.compile_mode,
                seconds=0.0,
                cache=CacheUse.OFF.value,
                reason=why_not,
                artifact_bytes=0,
            )
        )
        return
    signer = artifact_key(os.environ, journal=args.db)
    key = rt.compile_key = compile_key(rt)
    folders = private_compiler_folders()
    started = time.perf_counter()
    loaded = load_artifact(
        rt.recorder.artifacts, key, signer, root=folders.root, run_id=rt.recorder.run_id
    )
    use_cache_folder(loaded.folder)
    rt.compile_folder = loaded.folder
    rt.compile_cache = loaded.cache
    rt.compile_replaces = loaded.replaces
    rt.compile_files = _files(loaded.folder)
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
    # What warming a learned shape not run yet costs on top of its steps (runtime.learned).
    rt.compile_seconds = time.perf_counter() - started
    rt.recorder.record(
        Compiled(
            key=key.key,
            blocks=len(blocks),
            backend=BACKEND,
            mode=args.compile_mode,
            seconds=rt.compile_seconds,
            cache=loaded.cache.value,
            reason=loaded.reason,
            artifact_bytes=loaded.artifact_bytes,
        )
    )


def _files(folder: Path) -> frozenset[tuple[str, int]]:
    """The folder's files (path and size): what it holds, to tell whether compiling added to
    what was loaded. Lock files come and go and say nothing."""
    return frozenset(
        (str(path.relative_to(folder)), path.stat().st_size)
        for path in folder.rglob("*")
        if path.is_file() and not path.name.endswith(".lock")
    )


def keep_compiled(rt: RankRuntime) -> None:
    """The `keep-compiled` action (ready, with --compile): rank 0 keeps what its compiler cache
    holds in the journal, signed with the artifact key, when the compile did not load it all (a
    miss, a rejection, or shapes compiled after a hit); any failure to keep it (a journal or a
    folder that cannot be written, a key that cannot be read now) is journaled and the startup
    goes on."""
    key, folder = rt.compile_key, rt.compile_folder
    if key is None or folder is None or rt.layout.rank != 0:
        return
    try:
        if rt.compile_cache is CacheUse.HIT and _files(folder) == rt.compile_files:
            return  # everything compiled came from the artifact loaded
        data = pack(folder)
    except OSError as exc:
        rt.recorder.record(CompileKept(key=key.key, bytes=0, kept=False, reason=_unkept(exc)))
        return
    why = _keep(rt, key, data)
    rt.recorder.record(CompileKept(key=key.key, bytes=len(data), kept=why is None, reason=why))


def _keep(rt: RankRuntime, key: CompileKey, data: bytes) -> str | None:
    """Keep `data`, signed; None when kept, else why not."""
    if len(data) > MAX_ARTIFACT_BYTES:
        return f"{len(data):,} bytes is more than the {MAX_ARTIFACT_BYTES:,} kept at most"
    try:
        signer = artifact_key(os.environ, journal=rt.args.db)
        digest = hashlib.sha256(data).hexdigest()
        return rt.recorder.artifacts().keep(
            key,
            data,
            run_id=rt.recorder.run_id,
            signature=signer.sign(digest=digest, key=key.key),
            replace=rt.compile_replaces,
        )
    except ConfigError as exc:
        return f"the artifact key could not be read: {exc}"
    except JOURNAL_ERRORS as exc:
        return f"the journal could not be written: {exc}"
    except OSError as exc:
        return _unkept(exc)


def _unkept(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"the compiler's folder could not be packed: {where}{exc.strerror or exc}"
