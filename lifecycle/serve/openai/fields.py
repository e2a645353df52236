"""What a POST to /v1/videos or /v1/images/generations may carry (OpenAI's fields, and SGLang's
for what OpenAI does not name), read from a multipart form or JSON, and the request the ranks
run from it; every invalid field named in one 400."""

from __future__ import annotations

import json
from email import policy
from email.parser import BytesParser
from typing import Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lifecycle.core.format.records import Generation, Shape
from lifecycle.core.settings.modelspec import ModelSpec
from lifecycle.core.settings.validation import MAX_FRAMES, MAX_PROMPT_CHARS, MAX_SEED, MAX_STEPS
from lifecycle.serve.http.bodies import MAX_GUIDANCE, field_refusals
from lifecycle.serve.http.media import FPS, makes_images
from lifecycle.serve.openai.apierrors import OpenAIError, invalid_fields

SIZE = r"^[0-9]{1,5}x[0-9]{1,5}$"
MAX_FPS = 120
MAX_SECONDS = 3600.0


class Common(BaseModel):
    """What every generation takes; form fields arrive as text, so values are read laxly
    ("9" is 9), but a float is finite and a field nobody takes is refused."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    model: str | None = None
    size: str | None = Field(default=None, pattern=SIZE)
    num_inference_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=MAX_GUIDANCE)
    negative_prompt: str = Field(default="", max_length=MAX_PROMPT_CHARS)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


class VideoFields(Common):
    """POST /v1/videos: `seconds` (OpenAI's) or `num_frames` (SGLang's) for its length."""

    seconds: float | None = Field(default=None, gt=0.0, le=MAX_SECONDS)
    num_frames: int | None = Field(default=None, ge=1, le=MAX_FRAMES)
    fps: int = Field(default=FPS, ge=1, le=MAX_FPS)


class ImageFields(Common):
    """POST /v1/images/generations: one image, as base64 or as a URL this server serves."""

    size: str | None = Field(default=None, pattern=SIZE + "|^auto$")
    n: int = Field(default=1, ge=1, le=1)
    response_format: Literal["url", "b64_json"] = "url"


class FileSent:
    """A form field sent as a file: refused by `read_fields` beside every other field's
    problem (this server takes no reference assets)."""


async def posted_fields(request: Request) -> dict[str, Any]:
    """The fields of a POST: a multipart form (as OpenAI's SDK sends /v1/videos), a URL-encoded
    form, or a JSON object (also when sent as a form: `curl -d '{...}'` says it is one)."""
    content_type = request.headers.get("content-type", "")
    body = await request.body()
    if content_type.startswith("multipart/form-data"):
        return _multipart(content_type, body)
    if content_type.startswith("application/x-www-form-urlencoded") and not body.lstrip(
        b" \t\r\n"
    ).startswith(b"{"):
        from urllib.parse import parse_qsl

        return dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
    try:
        doc = json.loads(body or b"{}")
    except ValueError as exc:
        raise OpenAIError(400, f"the body is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise OpenAIError(400, "the body must be a JSON object", code="invalid_json")
    return doc


def _multipart(content_type: str, body: bytes) -> dict[str, Any]:
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise OpenAIError(400, "the multipart form cannot be read", code="invalid_form")
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        if part.get_filename() is not None:
            fields[name] = FileSent()
            continue
        payload = part.get_payload(decode=True)
        fields[name] = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else ""
    return fields


F = TypeVar("F", bound=Common)
NO_FILES = "files are not taken here (text-to-video and text-to-image only)"


def read_fields(kind: type[F], values: dict[str, Any]) -> tuple[F, list[tuple[str, str]]]:
    """The fields as `kind` reads them, and every refused field with why; a refused field is
    left out (a refused prompt stood in for), so that what the model cannot make of the others
    is found too."""
    files = [name for name, value in values.items() if isinstance(value, FileSent)]
    problems = [(name, NO_FILES) for name in files]
    values = {k: v for k, v in values.items() if k not in files}
    try:
        fields = kind.model_validate(values)
    except ValidationError as exc:
        errors = exc.errors()
    else:
        return fields, problems
    for error in errors:
        param = ".".join(str(p) for p in error["loc"]) or "body"
        extra = error["type"] == "extra_forbidden"
        problems.append((param, "not a field this server takes" if extra else error["msg"]))
    refused = {str(error["loc"][0]) for error in errors if error["loc"]}
    kept = {k: v for k, v in values.items() if k not in refused}
    kept["prompt"] = kept.get("prompt", "-")
    try:
        return kind.model_validate(kept), problems
    except ValidationError:
        return kind.model_validate({"prompt": "-"}), problems


def served_names(model: ModelSpec) -> tuple[str | None, ...]:
    """What a request may call the model served: its name, its path, and for a model by hub
    ID (ORG/NAME@COMMIT) the hub ID alone."""
    return (model.name, model.source, model.name.partition("@")[0])


def model_problems(given: str | None, model: ModelSpec, *, images: bool) -> list[tuple[str, str]]:
    """Why `given` does not name the model served (its name or its path), and why the model
    served does not make what the endpoint makes."""
    problems = []
    if given is not None and given not in served_names(model):
        problems.append(
            ("model", f"{given!r} is not served here; this server serves {model.name!r}")
        )
    if makes_images(model) != images:
        other = "POST /v1/images/generations" if makes_images(model) else "POST /v1/videos"
        problems.append(("model", f"{model.name} makes {model.task}: use {other}"))
    return problems


def sides(size: str | None, model: ModelSpec) -> tuple[int, int]:
    """WIDTHxHEIGHT, else the model's default."""
    if size is None or size == "auto":
        return model.default_width, model.default_height
    width, height = size.split("x")
    return int(width), int(height)


def frames_of(fields: VideoFields, model: ModelSpec) -> tuple[int, str | None]:
    """The frames asked for (num_frames, else seconds x fps to the model's nearest frame
    count 1 + k x its frame multiple, else its default) and the field that asked."""
    if fields.num_frames is not None:
        return fields.num_frames, "num_frames"
    if fields.seconds is not None:
        k = max(0, round((fields.seconds * fields.fps - 1) / model.frame_multiple))
        return 1 + k * model.frame_multiple, "seconds"
    return model.default_frames, None


def generation(
    fields: Common,
    model: ModelSpec,
    *,
    frames: int,
    frames_field: str | None,
    seed: int,
    media: str,
    problems: list[tuple[str, str]],
) -> Generation:
    """The request the ranks run; 400 naming every field refused (`problems`, from reading
    them) and every field the model cannot make."""
    width, height = sides(fields.size, model)
    steps = fields.num_inference_steps or model.default_steps
    given = {
        "width": (fields.size, width, "size"),
        "height": (fields.size, height, "size"),
        "frames": (frames_field, frames, frames_field),
        "steps": (fields.num_inference_steps, steps, "num_inference_steps"),
    }
    values: dict[str, Any] = {
        k: v for k, (asked, v, _) in given.items() if asked not in (None, "auto")
    }
    names = {k: param for k, (_, _, param) in given.items()}
    found = model_problems(fields.model, model, images=media == "png")
    if makes_images(model) == (media == "png"):  # its shape rules, for what it makes
        for item in field_refusals({**values, "response_format": media}, model):
            name = item["loc"][-1]
            found.append((names.get(name) or str(name), item["msg"]))
    refused = {param for param, _ in problems}
    every = problems + [(param, why) for param, why in found if param not in refused]
    if every:
        raise invalid_fields(every)
    return Generation(
        prompt=fields.prompt,
        negative_prompt=fields.negative_prompt,
        shape=Shape(width=width, height=height, frames=frames),
        steps=steps,
        guidance_scale=(
            model.default_guidance_scale if fields.guidance_scale is None else fields.guidance_scale
        ),
        seed=seed,
    )
