"""What a POST /generate body may be: its fields and their limits, what the model serving it
allows of them, its size as it arrives, and the answer to one refused."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Literal

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lifecycle.core.errors import LifecycleError
from lifecycle.core.format.records import Shape
from lifecycle.core.settings.modelspec import ModelSpec
from lifecycle.core.settings.validation import (
    MAX_FRAMES,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_SIDE,
    MAX_STEPS,
    shape_problems,
)
from lifecycle.serve.http.media import format_refusal, makes_images
from lifecycle.serve.openai.apierrors import CODES, PREFIX, OpenAIError

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


def field_refusals(values: Mapping[str, Any], model: ModelSpec) -> list[dict[str, Any]]:
    """Every field of a body (its values, the model's defaults for those left out) that the
    model cannot make, as a 422's detail items: an image model makes one frame, png is an
    image model's format, and the shape and steps are the model's to allow. A value of the
    wrong type is left to the body's own check."""

    def given(name: str, default: int) -> int | None:
        value = values.get(name)
        if value is None:
            return default
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    problems: list[tuple[str, str]] = []
    frames = values.get("frames")
    if makes_images(model) and frames not in (None, 1):
        problems.append(
            (
                "frames",
                f"frames must be 1 or left out for {model.name}, an image model, not {frames}",
            )
        )
    response_format = values.get("response_format", "json")
    if isinstance(response_format, str):
        refused = format_refusal(model, response_format)
        if refused is not None:
            problems.append(("response_format", refused))
    sides = [
        given("width", model.default_width),
        given("height", model.default_height),
        given("frames", model.default_frames),
        given("steps", model.default_steps),
    ]
    if all(side is not None for side in sides):
        width, height, count, steps = (int(side) for side in sides if side is not None)
        named = {name for name, _ in problems}
        problems += [
            (name, why)
            for name, why in shape_problems(
                model, Shape(width=width, height=height, frames=count), steps
            )
            if name not in named and name in values
        ]
    return [{"loc": ["body", name], "msg": why, "type": "value_error"} for name, why in problems]


class JsonByDefault:
    """POST /generate takes JSON alone: a body sent with curl's default content type (`curl -d
    '{"prompt": "a cat"}'`, a URL-encoded form) or with none is read as the JSON it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") == "/generate":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = dict(scope["headers"]).get(b"content-type", b"")
            if not given or given.startswith(b"application/x-www-form-urlencoded"):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


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
        v1 = str(scope.get("path", "")).startswith(PREFIX)
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await self._refuse(send, v1=v1)
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
            await self._refuse(send, v1=v1)

    async def _refuse(self, send: Send, *, v1: bool) -> None:
        """The 413: in OpenAI's error shape on /v1 paths, FastAPI's elsewhere."""
        said = f"body over {self.max_bytes} bytes"
        refusal = OpenAIError(413, said, code=CODES[413]).body() if v1 else {"detail": said}
        body = json.dumps(refusal).encode()
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


def body_refusal(exc: RequestValidationError, model: ModelSpec | None) -> list[dict[str, Any]]:
    """Every field of a refused body, and why, without the value sent (NaN or an infinity,
    which Python's JSON reader accepts, cannot be written back as JSON): the body's own check
    first, then what `model` cannot make of the fields it passed."""
    detail = [
        {"loc": list(error["loc"]), "msg": error["msg"], "type": error["type"]}
        for error in exc.errors()
    ]
    if model is not None and isinstance(exc.body, dict):
        refused = {tuple(item["loc"]) for item in detail}
        passed = {k: v for k, v in exc.body.items() if ("body", k) not in refused}
        detail += [
            item for item in field_refusals(passed, model) if tuple(item["loc"]) not in refused
        ]
    return detail


async def refuse_body(
    _request: Request, exc: Exception, *, model: ModelSpec | None = None
) -> JSONResponse:
    """422 naming every field that was refused, and why, in one list (FastAPI's shape)."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse(status_code=422, content={"detail": body_refusal(exc, model)})
