"""What a POST /generate body may be: its fields and their limits, what the model serving it
allows of them, its size as it arrives, and the answer to one refused."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.core.errors import LifecycleError
from lifecycle.core.settings.modelspec import ModelSpec
from lifecycle.core.settings.validation import (
    MAX_FRAMES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_SIDE,
    MAX_STEPS,
)
from lifecycle.serve.http.media import format_refusal, makes_images

MAX_BODY_BYTES = 64 * 1024
MAX_GUIDANCE = 100.0


class BodyTooLarge(LifecycleError):
    """A request body passed the size limit while it was being read."""

    def __init__(self, *, limit: int) -> None:
        super().__init__(f"body over {limit} bytes")
        self.limit = limit


class GenerateBody(BaseModel):
    """The body of POST /generate; omitted fields take the model's defaults.

    Strict: a size is a JSON integer, never a float (3.0, NaN, 1e400), a bool or a string;
    a float field, if one is added, is finite.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    width: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    height: int | None = Field(default=None, ge=16, le=MAX_SIDE)
    frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=MAX_GUIDANCE)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    response_format: Literal["json", "npy", "mp4", "png"] = "json"


def model_refusal(body: GenerateBody, model: ModelSpec) -> list[dict[str, Any]] | None:
    """What of `body` the model cannot make, as a 422's detail naming the field (as a refused
    body's): an image model makes one frame, and png is an image model's format. None when
    the model can make it all."""
    if makes_images(model) and body.frames not in (None, 1):
        field = "frames"
        why: str | None = (
            f"frames must be 1 or left out for {model.name}, an image model, not {body.frames}"
        )
    else:
        field = "response_format"
        why = format_refusal(model, body.response_format)
    if why is None:
        return None
    return [{"loc": ["body", field], "msg": why, "type": "value_error"}]


class BodyLimit:
    """Refuse a request body over `max_bytes` with 413: at once when its declared length is
    over, else as soon as that many bytes have arrived (a chunked body declares none), so
    that no more of it is held.

    The connection stays open: uvicorn drops the rest of the body as it arrives, where
    closing with unread data would reset the connection and could lose the 413 on its way.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send)
            return
        received = 0
        over = False
        responded = False

        async def counted_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge(limit=self.max_bytes)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal responded
            if over:
                return  # the application's answer to a body it never got whole is replaced
            responded = True
            await send(message)

        with contextlib.suppress(BodyTooLarge):
            await self.app(scope, counted_receive, guarded_send)
        if over and not responded:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps({"detail": f"body over {self.max_bytes} bytes"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def refuse_body(_request: Request, exc: Exception) -> JSONResponse:
    """422 naming each field that was refused, and why, without the value sent: NaN or an
    infinity (which Python's JSON reader accepts) cannot be written back as JSON."""
    assert isinstance(exc, RequestValidationError)
    detail = [
        {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
        for error in exc.errors()
    ]
    return JSONResponse(status_code=422, content={"detail": detail})
