"""One generation request through a pipeline, timed per stage and per step, with its memory."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from lifecycle.core.format.events import RequestFinished, RequestStarted
from lifecycle.core.format.records import Generation, GroupMark, RequestResult, StageRecord
from lifecycle.core.requestid import request_id_of
from lifecycle.runtime.device import MemoryMeter, synchronize
from lifecycle.runtime.group.lags import RankLag, request_lag
from lifecycle.runtime.pipeline import Pipeline
from lifecycle.runtime.rankruntime import RankRuntime


@dataclass(frozen=True, slots=True)
class Generated:
    """A request's result, and its video when it was kept (the rank that decodes)."""

    result: RequestResult
    video: torch.Tensor | None = None


def run_request(
    pipeline: Pipeline,
    request: Generation,
    *,
    meter: MemoryMeter,
    device: torch.device,
    decode: bool,
    keep_video: bool = False,
    after_step: Callable[[int], None] | None = None,
) -> Generated:
    """Run the text encoder, the denoiser and (when `decode`) the decoder, each measured as
    its own phase and named by the pipeline's components (a pipeline that measures its own
    components reports them instead).

    Only the rank that returns the video decodes; the others record the decoder as not run.
    `after_step` is called after each denoising step (progress, and where a stop may cut the
    request short by raising). `keep_video` keeps the decoded uint8 video with the result.
    """
    encoder, denoiser, decoder = _stage_names(pipeline)
    phases = _Phases(meter=meter, device=device)
    step_s: list[float] = []
    baseline = meter.current_bytes()
    started = time.perf_counter()

    since = phases.begin()
    embeds = pipeline.encode_prompt(request.prompt, request.negative_prompt)
    phases.end(encoder, since)

    since = phases.begin()
    latents = _denoise(
        pipeline, request, embeds, device=device, step_s=step_s, after_step=after_step
    )
    phases.end(denoiser, since)

    video = None
    if decode:
        since = phases.begin()
        video = pipeline.decode(latents, request.shape)
        phases.end(decoder, since)
        checksum = video_checksum(video)
    else:
        phases.stages.append(StageRecord(name=decoder, ran=False, seconds=0.0, peak_bytes=None))
        checksum = video_checksum(latents.contiguous().view(torch.uint8))
    stages = phases.stages
    measured = getattr(pipeline, "measured_stages", None)
    if measured is not None:
        stages = list(measured())
    peaks = [s.peak_bytes for s in stages if s.peak_bytes is not None]
    result = RequestResult(
        shape=request.shape,
        steps=request.steps,
        total_s=time.perf_counter() - started,
        step_s=tuple(step_s),
        stages=tuple(stages),
        memory_source=meter.source,
        baseline_bytes=baseline,
        peak_bytes=max(peaks) if peaks else None,
        checksum=checksum,
    )
    return Generated(result=result, video=video if keep_video else None)


@dataclass(slots=True, kw_only=True)
class _Phases:
    """A request's phases as they are measured: each from its start until the device is done
    with it, with the peak memory it reached."""

    meter: MemoryMeter
    device: torch.device
    stages: list[StageRecord] = field(default_factory=list)

    def begin(self) -> float:
        self.meter.reset_peak()
        return time.perf_counter()

    def end(self, name: str, since: float) -> None:
        synchronize(self.device)
        self.stages.append(
            StageRecord(
                name=name,
                ran=True,
                seconds=time.perf_counter() - since,
                peak_bytes=self.meter.peak_bytes(),
            )
        )


def _denoise(
    pipeline: Pipeline,
    request: Generation,
    embeds: Any,
    *,
    device: torch.device,
    step_s: list[float],
    after_step: Callable[[int], None] | None,
) -> torch.Tensor:
    """The denoiser's latents, each step's seconds (until the device is done with it) appended
    to `step_s` before `after_step` sees it."""
    last_step = [time.perf_counter()]

    def on_step(_step: int) -> None:
        synchronize(device)
        now = time.perf_counter()
        step_s.append(now - last_step[0])
        last_step[0] = now
        if after_step is not None:
            after_step(_step)

    return pipeline.denoise(
        embeds,
        request.shape,
        request.steps,
        seed=request.seed,
        guidance_scale=request.guidance_scale,
        on_step=on_step,
    )


def _stage_names(pipeline: Pipeline) -> tuple[str, str, str]:
    """The names of a request's three phases: the pipeline's first, middle and last
    components (text encoder, denoiser, decoder)."""
    names = pipeline.components
    if len(names) >= 3:
        return names[0], names[len(names) // 2], names[-1]
    return ("text_encoder", "dit", "vae")


def video_checksum(video: torch.Tensor) -> str:
    """A short, stable digest of an output tensor's bytes."""
    data = video.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def generate(
    rt: RankRuntime,
    request: Generation,
    *,
    source: str,
    request_id: str | None = None,
    keep_video: bool = False,
    after_step: Callable[[int], None] | None = None,
    traceparent: str | None = None,
) -> Generated:
    """Run one request on this rank, journaled as request_started / request_finished under
    `request_id` (the server's, the same on every rank; a new one when None); `after_step`
    runs after each denoising step (see run_request). A request the server cancelled is
    journaled with why (a non-fatal error) before it finishes. Its span, when traces are
    sent, is a child of `traceparent` (the server's span of it)."""
    from lifecycle.core.decisions.requesttime import RequestCancelled
    from lifecycle.core.format.events import error_event
    from lifecycle.runtime.telemetry.rankspans import current_rank_spans

    assert rt.pipeline is not None
    request_id = request_id_of(request_id)
    spans = current_rank_spans()
    if spans is not None:
        spans.join_request(request_id, traceparent)
    rt.slowdown.forgive()  # waiting for the request is not compute a slowed rank stretches
    marks = rt.comm.marks()
    before = sum(m.count for m in marks)
    rt.recorder.record(_started(request, request_id=request_id, source=source))
    try:
        generated = run_request(
            rt.pipeline,
            request,
            meter=rt.meter,
            device=rt.device,
            decode=rt.decodes,
            keep_video=keep_video,
            after_step=after_step,
        )
    except Exception as exc:
        if isinstance(exc, RequestCancelled):
            rt.recorder.record(error_event(exc, fatal=False, trigger=None, traceback=""))
        rt.recorder.record(_finished(rt, request_id, None, before=before))
        raise
    try:
        lag = request_lag(rt.comm, rt.recorder, since=marks)
    except Exception:
        rt.recorder.record(_finished(rt, request_id, None, before=before))
        raise
    rt.recorder.record(_finished(rt, request_id, generated.result, before=before, lag=lag))
    return generated


def _started(request: Generation, *, request_id: str, source: str) -> RequestStarted:
    """What a rank journals of a request as it starts: its shape and settings, not its text."""
    return RequestStarted(
        request_id=request_id,
        source=source,
        shape=request.shape,
        steps=request.steps,
        prompt_chars=len(request.prompt),
        negative_prompt_chars=len(request.negative_prompt),
        guidance_scale=request.guidance_scale,
        seed=request.seed,
    )


def _finished(
    rt: RankRuntime,
    request_id: str,
    result: RequestResult | None,
    *,
    before: int,
    lag: RankLag | None = None,
) -> RequestFinished:
    """A request's end as journaled: its result, or none when it failed; the collectives it
    ran since `before` (the groups' count when it started); this rank's lag entering them."""
    return RequestFinished(
        lag_s=None if lag is None else lag.seconds,
        lag_group="" if lag is None else lag.group,
        request_id=request_id,
        ok=result is not None,
        total_s=0.0 if result is None else result.total_s,
        checksum=None if result is None else result.checksum,
        peak_bytes=None if result is None else result.peak_bytes,
        **_collectives_since(rt, before),
    )


class _CollectivesSummary(TypedDict):
    collectives: int
    groups: tuple[GroupMark, ...]


def _collectives_since(rt: RankRuntime, before: int) -> _CollectivesSummary:
    """What a request's summary says of its collectives: how many ran, and every group's
    progress at its end (after ready their records stay in the ring)."""
    marks = rt.comm.marks()
    return {"collectives": sum(m.count for m in marks) - before, "groups": marks}
