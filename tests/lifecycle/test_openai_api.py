"""OpenAI's Videos API on a real `lifecycle serve --model tiny-wan`, driven by OpenAI's own SDK:
a job made through create_and_poll is a playable mp4 of the frames asked for, journaled under
its id; it is retrieved, listed and deleted; a running job shows its steps and is cancelled by
DELETE; an unknown id is the SDK's NotFoundError; every invalid field is named in one 400 in
OpenAI's error shape (while /generate keeps its own); /v1/models and SGLang's /models describe
the model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support import Served, journal_events
from tests.support.openaisdk import (
    SORA_WARNING,
    mp4_frames,
    sdk_client,
    served_model,
    timed,
    wait_until,
)

pytestmark = [pytest.mark.ranks, pytest.mark.filterwarnings(SORA_WARNING)]

# A shape tiny-wan makes in a few seconds on two cores.
SHAPE = {"size": "48x32"}
QUICK_VIDEO = {"num_frames": 9, "num_inference_steps": 3, "seed": 7}
LONG_VIDEO = {"num_frames": 9, "num_inference_steps": 200}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `lifecycle serve --model tiny-wan` for the module, ready; stopped at the end."""
    with served_model(tmp_path_factory.mktemp("tiny-wan"), "tiny-wan") as served:
        yield served


@pytest.fixture
def client(server: Served) -> Iterator[openai.OpenAI]:
    with sdk_client(server) as sdk:
        yield sdk


def test_a_video_made_through_the_sdk_is_a_playable_mp4_of_the_frames_asked(
    server: Served, client: openai.OpenAI
) -> None:
    """create_and_poll ends completed at progress 100 with its time and peak memory; its
    content is an H.264 mp4 of 9 frames of 48x32; every rank journaled it under the job id."""
    video = timed(
        "videos.create_and_poll",
        lambda: client.videos.create_and_poll(
            prompt="a cat walks in the rain", model="tiny-wan", **SHAPE, extra_body=QUICK_VIDEO
        ),
    )
    assert (video.status, video.progress, video.object, video.size) == (
        "completed", 100, "video", "48x32",
    )  # fmt: skip
    assert video.model == "tiny-wan" and video.seconds == "0.5625"  # 9 frames at 16 fps
    extra = video.model_extra or {}
    assert extra["inference_time_s"] > 0 and extra["peak_memory_mb"] > 0
    content = timed("videos.download_content", lambda: client.videos.download_content(video.id))
    assert content.response.headers["content-type"] == "video/mp4"
    frames = mp4_frames(content.read())
    assert frames.shape == (9, 32, 48, 3)
    started = [e for e in journal_events(server.db) if e.kind == "request_started"]
    assert video.id in {e.event.request_id for e in started}  # type: ignore[attr-defined]


def test_a_video_is_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    """A JSON POST makes a job too; retrieve and list (OpenAI's list shape) show it, DELETE
    answers OpenAI's deleted shape, and then the video and its content are gone (404)."""
    made = client.post(
        "/videos",
        cast_to=openai.types.Video,
        body={"prompt": "a heron", **SHAPE, **QUICK_VIDEO},
    )
    assert made.status == "queued"
    done = wait_until(client, made.id, lambda v: v.status == "completed", within=240)
    seen = timed("videos.retrieve", lambda: client.videos.retrieve(made.id))
    assert (seen.id, seen.completed_at) == (made.id, done.completed_at)
    page = timed("videos.list", lambda: client.videos.list(limit=100))
    assert made.id in [v.id for v in page.data]
    assert page.data == sorted(page.data, key=lambda v: v.created_at, reverse=True)
    deleted = timed("videos.delete", lambda: client.videos.delete(made.id))
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "video.deleted")
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content(made.id)


def test_a_running_video_shows_its_steps_and_delete_cancels_it(client: openai.OpenAI) -> None:
    """A job of 200 steps reads in_progress with its progress between 1 and 99 as the ranks
    step; DELETE cancels it at the next step, and the job behind it then runs to completion."""
    long = client.videos.create(prompt="a long walk", **SHAPE, extra_body=LONG_VIDEO)
    behind = client.videos.create(prompt="a short one", **SHAPE, extra_body=QUICK_VIDEO)
    assert client.videos.retrieve(behind.id).status == "queued"
    stepping = wait_until(
        client, long.id, lambda v: v.status == "in_progress" and v.progress > 0, within=240
    )
    assert 1 <= stepping.progress <= 99
    assert client.videos.delete(long.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(long.id)
    done = wait_until(
        client, behind.id, lambda v: v.status not in {"queued", "in_progress"}, within=240
    )
    assert done.status == "completed", done


def test_an_unknown_video_is_a_404_the_sdk_raises_as_not_found(client: openai.OpenAI) -> None:
    """retrieve, download_content and delete of an id never made raise openai.NotFoundError
    with OpenAI's error object: code not_found, param video_id."""
    with pytest.raises(openai.NotFoundError) as raised:
        timed("videos.retrieve (unknown id)", lambda: client.videos.retrieve("video_nothing"))
    assert raised.value.status_code == 404
    assert raised.value.code == "not_found" and raised.value.param == "video_id"
    with pytest.raises(openai.NotFoundError):
        client.videos.download_content("video_nothing")
    with pytest.raises(openai.NotFoundError):
        client.videos.delete("video_nothing")


def test_every_invalid_field_is_named_in_one_400_in_openais_shape(
    server: Served, client: openai.OpenAI
) -> None:
    """A multipart POST with a size off the grid and a frame count off the rule names both in
    one message (param: the first); a JSON body and a bad query are refused in OpenAI's shape,
    never FastAPI's detail list, which /generate keeps; a file sent in a form is named beside
    the other fields, a body over the limit is a 413 in the same shape, and JSON sent as a
    form (`curl -d`) is read as JSON."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.videos.create(prompt="x", size="47x32", extra_body={"num_frames": 8})
    assert raised.value.param == "size" and raised.value.code == "invalid_value"
    assert "size: width must be a multiple of 16" in raised.value.message
    assert "num_frames: frames must be 1 + 4k" in raised.value.message
    reply = server.client.post(
        "/v1/videos", json={"prompt": "", "fps": 0, "model": "sora-2", "style": "noir"}
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for field in ("prompt", "fps", "model", "style"):
        assert f"{field}: " in error["message"]
    listing = server.client.get("/v1/videos", params={"limit": 0})
    assert listing.status_code == 400 and listing.json()["error"]["param"] == "limit"
    legacy = server.client.post("/generate", json={"prompt": ""})
    assert legacy.status_code == 422 and "detail" in legacy.json()
    with_file = server.client.post(
        "/v1/videos",
        data={"prompt": "", "size": "axb", "seconds": "-1"},
        files={"input_reference": ("cat.png", b"\x89PNG", "image/png")},
    )
    assert with_file.status_code == 400
    said = with_file.json()["error"]["message"]
    for field in ("input_reference", "prompt", "size", "seconds"):
        assert f"{field}: " in said, said
    too_large = server.client.post(
        "/v1/videos", files={"input_reference": ("big.bin", b"\0" * 100_000)}
    )
    assert too_large.status_code == 413
    assert too_large.json()["error"]["code"] == "request_too_large"
    as_form = server.client.post(  # curl -d '{...}' sends JSON as a URL-encoded form
        "/v1/videos",
        content=b'{"prompt": "a cat", "size": "47x32"}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert as_form.status_code == 400 and as_form.json()["error"]["param"] == "size"


def test_the_models_are_listed_as_openai_and_described_as_sglang(
    server: Served, client: openai.OpenAI
) -> None:
    """/v1/models lists the one model served; /models gives SGLang's description of it, its
    precisions as the ranks journaled their components' loads."""
    models = timed("models.list", client.models.list)
    assert [(m.id, m.object, m.owned_by) for m in models.data] == [
        ("tiny-wan", "model", "lifecycle")
    ]
    described = server.client.get("/models").json()
    assert described == {
        "model_path": "tiny-wan",
        "task_type": "T2V",
        "task": "text-to-video",
        "pipeline_name": "wan_pipeline",
        "pipeline_class": "WanPipeline",
        "backend": "diffusers-components",
        "num_gpus": 1,
        "dit_precision": "fp32",
        "vae_precision": "fp32",
        "text_encoder_precision": "fp32",
    }


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", None])
def test_generate_reads_json_sent_as_curl_sends_it_by_default(
    server: Served, content_type: str | None
) -> None:
    """`curl -d '{"prompt": ...}' /generate` sends JSON as a URL-encoded form (or a client
    names no content type): /generate reads it as the JSON it is."""
    headers = {} if content_type is None else {"content-type": content_type}
    body = b'{"prompt": "a cat", "width": 48, "height": 32, "frames": 5, "steps": 1, "seed": 2}'
    reply = server.client.post("/generate", content=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert (reply.json()["width"], reply.json()["frames"]) == (48, 5)
