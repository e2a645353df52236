"""One generation request through a pipeline, timed per stage and per step, with its memory."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import torch

from lifecycle.core.config import Shape
from lifecycle.core.records import RequestResult, StageRecord
from lifecycle.runtime.device import MemoryMeter, synchronize
from lifecycle.runtime.pipeline import Pipeline


def run_request(
    pipeline: Pipeline,
    *,
    prompt: str,
    shape: Shape,
    steps: int,
    seed: int,
    meter: MemoryMeter,
    device: torch.device,
    decode: bool,
    after_step: Callable[[int], None] | None = None,
) -> RequestResult:
    """Run text encoder, DiT and (when `decode`) the decoder; measure each as its own phase.

    Only the rank that returns the video decodes; the others record the decoder as not run.
    `after_step` is called after each denoising step (progress, and where a stop may cut the
    request short by raising).
    """
    stages: list[StageRecord] = []
    step_s: list[float] = []
    baseline = meter.current_bytes()
    started = time.perf_counter()

    def begin() -> float:
        meter.reset_peak()
        return time.perf_counter()

    def end(name: str, since: float) -> None:
        synchronize(device)
        stages.append(
            StageRecord(
                name=name,
                ran=True,
                seconds=time.perf_counter() - since,
                peak_bytes=meter.peak_bytes(),
            )
        )

    since = begin()
    embeds = pipeline.encode_prompt(prompt)
    end("text_encoder", since)

    since = begin()
    last_step = [time.perf_counter()]

    def on_step(_step: int) -> None:
        synchronize(device)
        now = time.perf_counter()
        step_s.append(now - last_step[0])
        last_step[0] = now
        if after_step is not None:
            after_step(_step)

    latents = pipeline.denoise(embeds, shape, steps, seed=seed, on_step=on_step)
    end("dit", since)

    if decode:
        since = begin()
        video = pipeline.decode(latents, shape)
        end("vae", since)
        checksum = video_checksum(video)
        del video
    else:
        stages.append(StageRecord(name="vae", ran=False, seconds=0.0, peak_bytes=None))
        checksum = video_checksum(latents.contiguous().view(torch.uint8))
    peaks = [s.peak_bytes for s in stages if s.peak_bytes is not None]
    return RequestResult(
        shape=shape,
        steps=steps,
        total_s=time.perf_counter() - started,
        step_s=tuple(step_s),
        stages=tuple(stages),
        memory_source=meter.source,
        baseline_bytes=baseline,
        peak_bytes=max(peaks) if peaks else None,
        checksum=checksum,
    )


def video_checksum(video: torch.Tensor) -> str:
    """A short, stable digest of an output tensor's bytes."""
    data = video.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()
