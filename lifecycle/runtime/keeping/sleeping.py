"""Sleep and wake of a serving rank: the weights let go to the keeper (the rank's device memory
released), then brought back, attached or loaded, and held to the reference again."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from lifecycle.core.format.events import WeightsReleased
from lifecycle.core.format.records import Role
from lifecycle.runtime.device import release_cache
from lifecycle.runtime.keeping.weightpath import load_or_attach
from lifecycle.runtime.rankruntime import RankRuntime

NOT_KEPT = "no keeper holds them"


def release_weights(rt: RankRuntime) -> None:
    """Let the weights go where the keeper holds them (this rank maps its copy), and the
    device's cached memory with them; else keep them, and say why. Journaled."""
    started = time.perf_counter()
    if rt.keeper is None or not rt.kept:
        rt.recorder.record(
            WeightsReleased(key=rt.weights_key, bytes=0, seconds=0.0, reason=NOT_KEPT)
        )
        return
    released = rt.weights_bytes
    rt.pipeline = None
    gc.collect()
    freed = release_cache(rt.device)
    rt.recorder.record(
        WeightsReleased(
            key=rt.weights_key,
            bytes=released,
            seconds=time.perf_counter() - started,
            device_bytes=freed,
        )
    )


def restore_weights(
    rt: RankRuntime,
    *,
    load: Callable[[RankRuntime], None],
    compile_pipeline: Callable[[RankRuntime], None],
    apply_residency: Callable[[RankRuntime], None],
) -> None:
    """Bring the weights back after a sleep (attached from the keeper, or loaded where it no
    longer holds them), compiled and placed as before; the fixed request's output is held to
    the reference afterwards (the bounded warmup's measure is forgotten: it is run again)."""
    rt.measured.pop(Role.BOUNDED, None)
    if rt.pipeline is not None:
        return  # kept in the rank while asleep
    load_or_attach(rt, load)
    if rt.args.enable_torch_compile:
        compile_pipeline(rt)
    apply_residency(rt)
