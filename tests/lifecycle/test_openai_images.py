"""OpenAI's Images API on a real `lifecycle serve --model tiny-qwen-image`, driven by OpenAI's
own SDK: a generation is a PNG of the size asked, as base64 or at a URL this server serves; what
an image model cannot make is a 400 naming the field."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from PIL import Image

from tests.support import Served
from tests.support.openaisdk import SORA_WARNING, sdk_client, served_model, timed

pytestmark = [pytest.mark.ranks, pytest.mark.filterwarnings(SORA_WARNING)]

FIELDS = {"num_inference_steps": 2, "seed": 13, "negative_prompt": "blurry"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `lifecycle serve --model tiny-qwen-image` for the module, ready; stopped at the
    end."""
    with served_model(tmp_path_factory.mktemp("tiny-qwen-image"), "tiny-qwen-image") as served:
        yield served


@pytest.fixture
def client(server: Served) -> Iterator[openai.OpenAI]:
    with sdk_client(server) as sdk:
        yield sdk


def test_an_image_as_base64_is_a_png_of_the_size_asked(client: openai.OpenAI) -> None:
    """images.generate with response_format b64_json decodes to a 48x32 RGB PNG."""
    made = timed(
        "images.generate (b64_json)",
        lambda: client.images.generate(
            model="tiny-qwen-image", prompt="a cat at night", size="48x32",  # type: ignore[arg-type]
            n=1, response_format="b64_json", extra_body=FIELDS,
        ),
    )  # fmt: skip
    assert made.data is not None and len(made.data) == 1
    png = base64.b64decode(made.data[0].b64_json or "")
    image = Image.open(io.BytesIO(png))
    assert (image.format, image.size, image.mode) == ("PNG", (48, 32), "RGB")


def test_an_image_as_a_url_is_served_by_this_server(server: Served, client: openai.OpenAI) -> None:
    """response_format url answers a URL of this server's that serves the PNG."""
    made = timed(
        "images.generate (url)",
        lambda: client.images.generate(
            prompt="a cat at night",
            size="48x32",
            response_format="url",
            extra_body=FIELDS,  # type: ignore[arg-type]
        ),
    )
    assert made.data is not None
    url = made.data[0].url or ""
    assert url.startswith(f"{server.url}/v1/images/")
    reply = httpx.get(url, timeout=60)
    assert reply.status_code == 200 and reply.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(reply.content)).size == (48, 32)


def test_what_an_image_model_cannot_make_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    """Two images, a size off the grid, and a video asked of an image model are refused with
    OpenAI's error object naming each field."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.generate(prompt="x", n=2, size="40x32")  # type: ignore[arg-type]
    assert raised.value.param in {"size", "n"}
    assert "n: " in raised.value.message and "size: " in raised.value.message
    with pytest.raises(openai.BadRequestError) as video:
        client.videos.create(prompt="x")
    assert video.value.param == "model" and "/v1/images/generations" in video.value.message


def test_images_past_a_full_line_are_a_429_to_come_back_later(server: Served) -> None:
    """Twenty images asked at once: those the line (one running, eight waiting) has no room
    for are OpenAI's 429 with Retry-After, which its SDK retries; the others are made."""
    body = {"prompt": "a cat", "size": "48x32", "response_format": "b64_json",
            "num_inference_steps": 40, "seed": 1}  # fmt: skip
    with (
        httpx.Client(
            base_url=server.url, timeout=300, limits=httpx.Limits(max_connections=30)
        ) as http,
        ThreadPoolExecutor(20) as pool,
    ):
        pending = [pool.submit(http.post, "/v1/images/generations", json=body) for _ in range(20)]
        replies = [p.result(timeout=300) for p in pending]
    assert {r.status_code for r in replies} == {200, 429}, [r.text for r in replies]
    for full in (r for r in replies if r.status_code == 429):
        assert full.headers["retry-after"]
        error = full.json()["error"]
        assert (error["code"], error["type"]) == ("queue_full", "rate_limit_exceeded")
