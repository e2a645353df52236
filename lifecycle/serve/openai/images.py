"""OpenAI's Images API over the service: POST /v1/images/generations answers when the image is
made (one at a time, in line with /generate), as base64 or as a URL this server serves."""

from __future__ import annotations

import base64
import time
import uuid
from functools import partial

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lifecycle.serve.http.media import png_bytes
from lifecycle.serve.http.servedranks import Reply
from lifecycle.serve.http.service import Service
from lifecycle.serve.openai.answers import admit, content, kept, traceparent_of
from lifecycle.serve.openai.apierrors import OpenAIError
from lifecycle.serve.openai.fields import ImageFields, generation, posted_fields, read_fields
from lifecycle.serve.openai.jobs import COMPLETED, Job, JobStore
from lifecycle.serve.openai.runner import outcome
from lifecycle.serve.ranks.cancel import RequestPastDeadline, RequestWithdrawn
from lifecycle.serve.ranks.control import ServiceUnavailable
from lifecycle.serve.ranks.inflight import RequestFailed


def add_images(app: FastAPI, service: Service, store: JobStore) -> None:
    model = service.request_model

    @app.post("/v1/images/generations")
    async def create_image(http: Request) -> dict[str, object]:
        fields, problems = read_fields(ImageFields, await posted_fields(http))
        request = generation(
            fields,
            model,
            frames=1,
            frames_field=None,
            seed=service.args.seed if fields.seed is None else fields.seed,
            media="png",
            problems=problems,
        )
        admit(service, request)
        image_id = f"img_{uuid.uuid4().hex}"
        run = partial(
            service.generate,
            request,
            request_id=image_id,
            return_video=True,
            traceparent=traceparent_of(http),
        )
        reply = await _made(service, run)
        png = await anyio.to_thread.run_sync(png_bytes, reply.video)
        created = int(time.time())
        size = f"{request.shape.width}x{request.shape.height}"
        if fields.response_format == "b64_json":
            item: dict[str, object] = {"b64_json": base64.b64encode(png).decode("ascii")}
        else:
            job = Job(
                id=image_id, kind="image", status=COMPLETED, created_at=created,
                model=model.name, prompt=request.prompt, size=size, num_frames=1, fps=1,
                num_inference_steps=request.steps, seed=request.seed,
            )  # fmt: skip
            store.put(job)
            store.finish(image_id, content=png, **outcome(reply.summary))
            item = {"url": f"{str(http.base_url).rstrip('/')}/v1/images/{image_id}/content"}
        return {
            "created": created,
            "data": [{**item, "revised_prompt": None}],
            "output_format": "png",
            "size": size,
            **outcome(reply.summary),
        }

    @app.get("/v1/images/{image_id}/content")
    async def image_content(image_id: str) -> Response:
        return await content(store, kept(store, image_id, "image"))


async def _made(service: Service, run: partial[Reply]) -> Reply:
    """The image made in a worker thread once its turn comes; its failure in OpenAI's shape."""
    try:
        with service.place_in_line():
            return await anyio.to_thread.run_sync(run)
    except RequestFailed as exc:
        answer = service.failed_request(exc)
        raise OpenAIError(
            500, f"{answer['detail']}; explain: {answer['diagnose']}",
            kind="server_error", code="rank_failed",
        ) from None  # fmt: skip
    except RequestPastDeadline as exc:
        raise OpenAIError(504, str(exc), kind="server_error", code="deadline_exceeded") from None
    except (ServiceUnavailable, RequestWithdrawn) as exc:
        retry = getattr(exc, "retry_after_s", None)
        headers = None if retry is None else {"Retry-After": str(retry)}
        if getattr(exc, "status", None) == "busy":  # the line is full: come back later
            raise OpenAIError(429, str(exc), code="queue_full", headers=headers) from None
        raise OpenAIError(
            503, str(exc), kind="server_error", code="unavailable", headers=headers
        ) from None
