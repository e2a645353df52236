"""What the /v1 endpoints share: a request admitted as /generate admits it, the trace a client
names, a kept job's content or why there is none, and a job as OpenAI's objects show it."""

from __future__ import annotations

import re
import time
from pathlib import Path

import anyio.to_thread
from fastapi import Request
from fastapi.responses import Response

from lifecycle.core.format.records import Generation
from lifecycle.serve.http.requestline import RETRY_AFTER_S
from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.apierrors import OpenAIError
from lifecycle.serve.openai.jobs import COMPLETED, FAILED, Job, JobStore

TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
MEDIA_TYPES = {"video": "video/mp4", "image": "image/png"}


def admit(service: Service, request: Generation) -> None:
    """503 before the ranks are ready; 400 for a request refused by memory (its predicted
    peak over a rank's budget) or by time (predicted past --request-timeout), in the words
    /generate refuses it with."""
    ok, status = service.health()
    if not ok:
        again = (
            {"Retry-After": str(RETRY_AFTER_S)} if status in ("starting", "restarting") else None
        )
        raise OpenAIError(
            503, f"not ready: {status}", kind="server_error", code="not_ready", headers=again
        )
    views = service.views_now()
    refusal = service.bounds.refusal(views, request.shape)
    if refusal is not None:
        raise OpenAIError(400, f"refused: {refusal.text()}", code="memory_exceeded", param="size")
    too_long = service.bounds.time_refusal(views, request, limit_s=service.request_timeout_s)
    if too_long is not None:
        raise OpenAIError(400, too_long, code="predicted_past_timeout", param="num_inference_steps")


def traceparent_of(http: Request) -> str | None:
    """The client's W3C `traceparent`, when it has the one form: the ranks' spans join it."""
    given = http.headers.get("traceparent")
    return given if given is not None and TRACEPARENT.match(given) else None


def kept(store: JobStore, job_id: str, kind: str) -> Job:
    """The job of `kind` under `job_id`; 404 naming it when there is none."""
    job = store.get(job_id)
    if job is None or job.kind != kind:
        raise OpenAIError(
            404,
            f"no {kind} {job_id!r} here (a finished one is kept --job-ttl, then forgotten)",
            code="not_found",
            param=f"{kind}_id",
        )
    return job


async def content(store: JobStore, job: Job) -> Response:
    """A completed job's mp4 or png; 409 for one not finished, 404 for one that failed (it
    made nothing), 410 for one whose content has expired or was removed."""
    if job.status == FAILED:
        why = job.error.message if job.error is not None else "failed"
        raise OpenAIError(
            404, f"{job.kind} {job.id} failed, so it has no content: {why}", code="job_failed"
        )
    if job.status != COMPLETED:
        raise OpenAIError(
            409, f"{job.kind} {job.id} is {job.status}: its content is not made yet",
            code="not_ready",
        )  # fmt: skip
    path = store.content_path(job)
    expired = job.expired
    if expired is None and job.expires_at is not None and time.time() >= job.expires_at:
        expired = f"expired at {job.expires_at}"
    if expired is None and not path.exists():
        expired = "its file is gone from the jobs folder"
    if expired is not None:
        raise OpenAIError(410, f"{job.kind} {job.id}: content {expired}", code="expired")
    data = await anyio.to_thread.run_sync(Path.read_bytes, path)
    return Response(content=data, media_type=MEDIA_TYPES[job.kind])


def video_json(job: Job, progress: int) -> dict[str, object]:
    """A video job as OpenAI's video object, with what SGLang reports of it."""
    error = None if job.error is None else {"code": job.error.code, "message": job.error.message}
    return {
        "id": job.id,
        "object": "video",
        "created_at": job.created_at,
        "status": job.status,
        "model": job.model,
        "progress": progress,
        "prompt": job.prompt,
        "seconds": job.seconds,
        "size": job.size,
        "completed_at": job.completed_at,
        "expires_at": job.expires_at,
        "error": error,
        "remixed_from_video_id": None,
        "num_frames": job.num_frames,
        "fps": job.fps,
        "num_inference_steps": job.num_inference_steps,
        "seed": job.seed,
        "inference_time_s": job.inference_time_s,
        "peak_memory_mb": job.peak_memory_mb,
    }
