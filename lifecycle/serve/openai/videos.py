"""OpenAI's Videos API over the service: POST /v1/videos answers at once with a queued job,
which runs in its turn; GET it, list them, download its mp4, DELETE to cancel or forget it."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.answers import admit, content, kept, traceparent_of, video_json
from lifecycle.serve.openai.apierrors import OpenAIError
from lifecycle.serve.openai.fields import (
    VideoFields,
    frames_of,
    generation,
    posted_fields,
    read_fields,
)
from lifecycle.serve.openai.jobs import QUEUED, Job
from lifecycle.serve.openai.runner import JobRunner

POLL_AFTER_MS = 250  # what a queued or running job tells the SDK's poll to wait
MAX_LIST = 100


def add_videos(app: FastAPI, service: Service, jobs: JobRunner) -> None:
    model = service.request_model
    store = jobs.store

    def shown(job: Job) -> dict[str, object]:
        return video_json(job, jobs.progress(job))

    @app.post("/v1/videos")
    async def create_video(http: Request) -> JSONResponse:
        """A video job, queued: its id names the request every rank journals."""
        fields, problems = read_fields(VideoFields, await posted_fields(http))
        frames, asked = frames_of(fields, model)
        request = generation(
            fields,
            model,
            frames=frames,
            frames_field=asked,
            seed=service.args.seed if fields.seed is None else fields.seed,
            media="mp4",
            problems=problems,
        )
        admit(service, request)
        job = Job(
            id=f"video_{uuid.uuid4().hex}",
            kind="video",
            status=QUEUED,
            created_at=int(time.time()),
            model=model.name,
            prompt=request.prompt,
            size=f"{request.shape.width}x{request.shape.height}",
            num_frames=request.shape.frames,
            fps=fields.fps,
            num_inference_steps=request.steps,
            seed=request.seed,
        )
        jobs.submit(job, request, traceparent=traceparent_of(http))
        return JSONResponse(content=shown(job), headers={"X-Request-ID": job.id})

    @app.get("/v1/videos")
    async def list_videos(
        after: str | None = None,
        limit: int = Query(default=20, ge=1, le=MAX_LIST),
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, object]:
        """The videos kept, newest first unless `order` says asc; `after` the last id of the
        page before."""
        listed = store.listed("video")
        if order == "desc":
            listed.reverse()
        if after is not None:
            ids = [job.id for job in listed]
            if after not in ids:
                raise OpenAIError(400, f"after: no video {after!r} here", code="invalid_value",
                                  param="after")  # fmt: skip
            listed = listed[ids.index(after) + 1 :]
        page = listed[:limit]
        return {
            "object": "list",
            "data": [shown(job) for job in page],
            "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None,
            "has_more": len(listed) > limit,
        }

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(video_id: str) -> JSONResponse:
        job = kept(store, video_id, "video")
        waiting = job.status in (QUEUED, "in_progress")
        headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)} if waiting else None
        return JSONResponse(content=shown(job), headers=headers)

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, variant: str = "video") -> Response:
        """The video's mp4; only the `video` variant is made."""
        if variant != "video":
            raise OpenAIError(
                400, f"variant: only 'video' is made here, not {variant!r}",
                code="invalid_value", param="variant",
            )  # fmt: skip
        return await content(store, kept(store, video_id, "video"))

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str) -> dict[str, object]:
        """Cancel a queued or running video (a running one stops at the next denoising step
        on every rank), or delete a finished one and its mp4."""
        kept(store, video_id, "video")
        if jobs.delete(video_id) is None:
            kept(store, video_id, "video")  # deleted meanwhile: 404 as if never
        return {"id": video_id, "object": "video.deleted", "deleted": True}
