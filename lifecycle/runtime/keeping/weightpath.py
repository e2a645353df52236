"""A rank's weights path at gate-check: attach to the host keeper's copy of the weights key, or
load from disk and give the finished weights to the keeper; and the check of an attached
startup's output against the key's reference before it may be ready (fail closed)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping
from typing import Any

import structlog
import torch

from lifecycle import __version__
from lifecycle.core.decisions.weightskey import ATTACH, LOAD, weights_key
from lifecycle.core.errors import JournalError
from lifecycle.core.format.events import (
    AttachRejected,
    ReferenceOutput,
    WeightsKept,
    WeightsPath,
)
from lifecycle.runtime.keeping.keeperwire import (
    KeeperLink,
    KeeperUnavailable,
    ask,
    keeper_link,
)
from lifecycle.runtime.keeping.skeleton import (
    NotPackable,
    pack,
    read_fd,
    read_skeleton_file,
    skeleton_file,
    unpack,
    weights_bytes,
)
from lifecycle.runtime.rankruntime import RankRuntime

log = structlog.get_logger("lifecycle.runtime")


NO_REFERENCE = "no reference output to hold attached weights to"
OUTPUT_DIFFERS = "the output of the fixed request differs from the reference"


class AttachRefused(Exception):
    """What the keeper handed is not to be served with; what differed, in words."""


def load_or_attach(rt: RankRuntime, load: Any) -> None:
    """gate-check's weights: attached from the keeper where it holds this rank's weights key,
    else loaded by `load(rt)` (the pipeline built, its components read from disk) and given to
    the keeper when there is one; journaled either way (weights_path, weights_kept)."""
    rt.weights_key = key = weights_key(
        rt.args, device=str(rt.device), torch_version=torch.__version__, lifecycle=__version__
    )
    link, why = keeper_link(rt.args.keeper, journal=rt.args.db, env=os.environ)
    rt.keeper = link
    if link is not None:
        started = time.perf_counter()
        try:
            attached = _attach(rt, link, key)
        except KeeperUnavailable as exc:
            # Said once: this startup goes on without the keeper (nothing is given to it).
            why = f"keeper {link.path}: {exc}"
            if link.named or not exc.absent:  # at auto, a socket left behind is no keeper
                log.warning("keeper_unavailable", keeper=str(link.path), reason=str(exc))
            rt.keeper = None
        except AttachRefused as exc:
            why = f"attach rejected: {exc}"
            rt.recorder.record(AttachRejected(key=key, what=str(exc), expected="", observed=""))
            _drop(link, key, str(exc))
        else:
            if attached is not None:
                rt.pipeline, rt.weights_bytes = attached
                rt.attached = rt.kept = True
                rt.recorder.record(
                    WeightsPath(
                        path=ATTACH,
                        key=key,
                        keeper=str(link.path),
                        bytes=rt.weights_bytes,
                        seconds=time.perf_counter() - started,
                    )
                )
                return
            why = "the keeper does not hold this weights key"
    _journaled_load(rt, load, why or None, keeper=link)
    if link is not None and rt.keeper is not None:
        give(rt, link, key, load)


def _attach(rt: RankRuntime, link: KeeperLink, key: str) -> tuple[Any, int] | None:
    """The keeper's pipeline of `key` and its weights' bytes; None when it holds none."""
    answer, fds = ask(link.path, link.key, {"op": "attach", "key": key})
    try:
        if not answer.get("held"):
            return None
        return _unpacked(rt, link, key, answer, fds)
    finally:
        for fd in fds:
            os.close(fd)


def _unpacked(
    rt: RankRuntime, link: KeeperLink, key: str, answer: Mapping[str, Any], fds: list[int]
) -> tuple[Any, int]:
    """The pipeline of the keeper's files `fds` as `answer` describes them, and its weights'
    bytes; AttachRefused for files that are not what was asked for."""
    sizes = answer.get("skeleton_bytes"), answer.get("blob_bytes")
    if len(fds) != 2 or not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise AttachRefused("the keeper's answer does not name its two files and their sizes")
    skeleton_bytes, blob_bytes = int(sizes[0]), int(sizes[1])  # type: ignore[arg-type]
    data = read_fd(fds[0], skeleton_bytes)
    if not link.key.skeleton_verifies(
        answer.get("signature"), data, key=key, blob_bytes=blob_bytes
    ):
        raise AttachRefused("the skeleton's signature does not verify for this weights key")
    try:
        slots, skeleton = read_skeleton_file(data)
        pipeline = unpack(skeleton, slots, fds[1], blob_bytes, comm=rt.comm, device=rt.device)
    except (ValueError, OSError) as exc:
        raise AttachRefused(f"the keeper's files do not unpack ({exc})") from None
    return pipeline, sum(s.nbytes for s in slots)


def give(rt: RankRuntime, link: KeeperLink, key: str, load: Any) -> None:
    """Offer the rank's loaded weights to the keeper, when this rank is the first of its host
    to claim the key (another rank's claim, or weights held already: it serves with its own and
    packs nothing). On the host each storage is let go as it is copied into the shared file
    (never two copies at once), and the rank serves with that copy: the keeper's too once it
    keeps it. Journaled; never fails the startup (a copy that fails midway loads again)."""
    started = time.perf_counter()
    outcome, reason, nbytes = "failed", None, 0
    try:
        refusal = _claim(link, key)
    except KeeperUnavailable as exc:
        refusal = ("failed", str(exc))
        log.warning("keeper_unavailable", keeper=str(link.path), reason=str(exc))
    if refusal is not None:
        # The keeper holds them already, or another rank of the host is giving them, or it
        # cannot be asked: this rank serves with its own copy and packs nothing.
        outcome, reason = refusal
        rt.kept = reason == HELD_ALREADY
        _record_kept(rt, key, outcome, 0, started, reason)
        return
    on_host = rt.device.type == "cpu"
    try:
        packed = pack(rt.pipeline, rt.comm, release=on_host)
    except NotPackable as exc:
        reason = f"the pipeline's objects cannot be pickled ({exc})"
    except OSError as exc:
        # Part of the rank's weights were let go into a copy that could not be finished.
        reason = f"the copy for the keeper failed ({exc.strerror or exc}): loaded again"
        _record_kept(rt, key, "failed", 0, started, reason)
        _journaled_load(rt, load, reason, keeper=rt.keeper)
        return
    else:
        nbytes = packed.weights_bytes
        skeleton_fd, size = skeleton_file(packed)
        try:
            data = read_fd(skeleton_fd, size)
            signature = link.key.sign_skeleton(data, key=key, blob_bytes=packed.blob_bytes)
            header = {
                "op": "keep",
                "key": key,
                "skeleton_bytes": size,
                "blob_bytes": packed.blob_bytes,
                "signature": signature,
            }
            try:
                answer, fds = ask(link.path, link.key, header, (skeleton_fd, packed.blob_fd))
            except KeeperUnavailable as exc:
                answer, fds = {"outcome": "failed", "reason": str(exc)}, []
                log.warning("keeper_unavailable", keeper=str(link.path), reason=str(exc))
            for fd in fds:
                os.close(fd)
            outcome = str(answer.get("outcome"))
            reason = str(answer.get("reason") or "")[:300] or None
            if outcome == "held":  # given by another rank since the claim expired
                reason = HELD_ALREADY
            if on_host:
                # The rank's own copy was let go as it was written: it serves with the packed
                # one, which is the keeper's too when it kept it.
                own = {**header, "held": True}
                try:
                    _switch(rt, *_unpacked(rt, link, key, own, [skeleton_fd, packed.blob_fd]))
                except AttachRefused as exc:
                    _journaled_load(
                        rt, load, f"the packed copy could not be mapped ({exc})", keeper=rt.keeper
                    )
                    outcome, reason = "failed", str(exc)
            rt.kept = outcome in ("kept", "held")
        finally:
            os.close(skeleton_fd)
            os.close(packed.blob_fd)
    _record_kept(rt, key, outcome, nbytes, started, reason)


def _record_kept(
    rt: RankRuntime, key: str, outcome: str, nbytes: int, started: float, reason: str | None
) -> None:
    rt.recorder.record(
        WeightsKept(
            key=key,
            outcome=outcome,
            bytes=nbytes,
            seconds=time.perf_counter() - started,
            reason=reason,
        )
    )


HELD_ALREADY = "held already: this rank serves with its own copy"
BEING_GIVEN = "another rank of this host is giving them: this rank serves with its own copy"


def _claim(link: KeeperLink, key: str) -> tuple[str, str] | None:
    """None when this rank is the one to give `key`'s weights; else the outcome and why not."""
    answer, fds = ask(link.path, link.key, {"op": "claim", "key": key})
    for fd in fds:
        os.close(fd)
    if answer.get("claimed") is True:
        return None
    return ("held", HELD_ALREADY if answer.get("held") else BEING_GIVEN)


def _switch(rt: RankRuntime, pipeline: Any, nbytes: int) -> None:
    """Serve with the packed copy; the rank's own is let go."""
    rt.pipeline, rt.weights_bytes = pipeline, nbytes
    gc.collect()


def _drop(link: KeeperLink, key: str, why: str) -> None:
    try:
        _, fds = ask(link.path, link.key, {"op": "drop", "key": key, "why": why})
    except KeeperUnavailable:
        return
    for fd in fds:
        os.close(fd)


def reference_key(rt: RankRuntime, shape: str, steps: int) -> str:
    """What the reference output is kept under: the weights key and everything else that
    changes the fixed request's output (its shape and steps, the seed, compile, the threads)."""
    import hashlib

    args = rt.args
    compiled = f"{args.compile_mode}" if args.enable_torch_compile else "eager"
    threads = torch.get_num_threads()
    text = f"{rt.weights_key} {shape} {steps} seed={args.seed} {compiled} threads={threads}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_reference(rt: RankRuntime, checksum: str, ref_key: str) -> str | None:
    """Compare this rank's output of the fixed request with its reference, journaling the
    outcome: what differed when the weights were attached and the output is not the
    reference's (or there is none to hold them to), else None."""
    try:
        found = rt.recorder.reference_output(ref_key)
    except JournalError:
        found = None
    run_id = rt.recorder.run_id
    if found is None:
        if rt.attached:
            rt.recorder.record(
                AttachRejected(
                    key=rt.weights_key, what=NO_REFERENCE, expected="", observed=checksum
                )
            )
            return "no reference"
        rt.recorder.record(
            ReferenceOutput(key=ref_key, checksum=checksum, since_run=run_id, outcome="new")
        )
        return None
    expected, since = found
    if checksum == expected:
        rt.recorder.record(
            ReferenceOutput(key=ref_key, checksum=checksum, since_run=since, outcome="matched")
        )
        return None
    if rt.attached:
        rt.recorder.record(
            AttachRejected(
                key=rt.weights_key, what=OUTPUT_DIFFERS, expected=expected, observed=checksum
            )
        )
        return "output differs"
    # Weights read from disk are the truth: their output is the key's reference from now on.
    rt.recorder.record(
        ReferenceOutput(key=ref_key, checksum=checksum, since_run=run_id, outcome="replaced")
    )
    return None


def reject_attached(rt: RankRuntime, why: str, load: Any) -> None:
    """Detach (the keeper drops the key) and load from disk, journaled as a load. The weights
    loaded are not given back now (the next startup of the key gives its own): this rank
    serves with what it read, held to the reference as any load is."""
    if rt.keeper is not None:
        _drop(rt.keeper, rt.weights_key, why)
    _journaled_load(rt, load, f"attach rejected: {why}", keeper=rt.keeper)


def _journaled_load(
    rt: RankRuntime, load: Any, reason: str | None, *, keeper: KeeperLink | None
) -> None:
    """The pipeline built and read from disk (anew: the one before let go first), journaled
    as a load with `reason`, naming the keeper asked."""
    if rt.pipeline is not None:
        rt.pipeline = None
        gc.collect()
    started = time.perf_counter()
    load(rt)
    rt.attached = rt.kept = False
    rt.weights_bytes = weights_bytes(rt.pipeline)
    rt.recorder.record(
        WeightsPath(
            path=LOAD,
            key=rt.weights_key,
            keeper=_where(keeper),
            bytes=rt.weights_bytes,
            seconds=time.perf_counter() - started,
            reason=reason,
        )
    )


def _where(link: KeeperLink | None) -> str:
    return "" if link is None else str(link.path)
