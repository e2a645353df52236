"""An image model served and booted by name: `--model tiny-qwen-image` (Qwen-Image built at
start, offline), its /generate replies as PNG, npy and JSON, and what an image model refuses."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.families import qwen_image_call
from lifecycle.adapters.diffusers.wan.wanadapter import to_uint8
from lifecycle.core.format.events import Transition, WarmupRecord
from lifecycle.core.settings.modelspec import MODEL_PRESETS
from lifecycle.serve.http.media import format_refusal
from lifecycle.store.journal import Journal
from tests.adapters.test_diffusers_cli import without_diffusers
from tests.conftest import assert_refused_before_start, processes_in, run_cli
from tests.support import Served, journal_events, serve
from tests.support.families import QUICK

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

MODEL = "tiny-qwen-image"
# Small enough for a few seconds on two cores; width and height on the model's 16-pixel grid,
# unequal, so that a reply with its sides swapped shows.
REQUEST: dict[str, Any] = {
    "prompt": "a cat walks in the rain at night",
    "negative_prompt": "blurry, dark",
    "width": 48,
    "height": 32,
    "steps": 2,
    "seed": 13,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One `lifecycle serve --model tiny-qwen-image` for the module, ready; stopped at the
    end, exit 0, leaving no process behind."""
    workdir = tmp_path_factory.mktemp("tiny-qwen-image")
    try:
        with serve(workdir, "--model", MODEL, *QUICK) as served:
            served.wait_for_health(200, within=240)
            yield served
            assert served.stop() == 0
    finally:
        leftovers = processes_in(workdir)
        for pid in leftovers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    assert leftovers == [], f"processes outlived the server: {leftovers}"


def post(server: Served, **fields: Any) -> Any:
    return server.client.post("/generate", json={**REQUEST, **fields}, timeout=240)


def npy_of(server: Served, **fields: Any) -> np.ndarray:
    reply = post(server, response_format="npy", **fields)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "application/x-npy"
    return np.load(io.BytesIO(reply.content), allow_pickle=False)


@functools.cache
def tiny_qwen_image() -> Any:
    """diffusers' own QwenImagePipeline on tiny-qwen-image's weights, built here."""
    from lifecycle.adapters.diffusers.qwen.tinyqwen import build_tiny_qwen_image

    pipe = build_tiny_qwen_image()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def qwen_image_pipeline(**call: Any) -> np.ndarray:
    """What QwenImagePipeline on tiny-qwen-image's weights makes of REQUEST (and `call`), as
    uint8."""
    return to_uint8(qwen_image_call(tiny_qwen_image(), REQUEST, **call))


def test_a_png_reply_is_the_one_frame_as_an_8_bit_rgb_image(server: Served) -> None:
    """response_format png is an 8-bit RGB PNG of the request's width and height, pixel for
    pixel the frame the npy reply of the same request holds."""
    from PIL import Image

    reply = post(server, response_format="png")
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"] == "image/png"
    assert reply.headers["x-request-id"]
    # IHDR: bit depth 8, colour type 2 (truecolour RGB, no alpha).
    assert reply.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert reply.content[12:16] == b"IHDR" and reply.content[24:26] == bytes([8, 2])
    image = Image.open(io.BytesIO(reply.content))
    assert (image.format, image.mode, image.size) == ("PNG", "RGB", (48, 32))
    frames = npy_of(server)
    assert np.array_equal(np.asarray(image), frames[0])


def test_an_npy_reply_is_one_frame_with_frames_absent_or_one(server: Served) -> None:
    """An image model's npy reply is (1, height, width, 3) uint8, the same whether `frames`
    is left out or 1."""
    absent = npy_of(server)
    one = npy_of(server, frames=1)
    assert absent.shape == (1, 32, 48, 3) and absent.dtype == np.uint8
    assert np.array_equal(absent, one)
    assert int(absent.max()) > int(absent.min())  # an image, not a blank


def test_guidance_scale_is_qwen_images_true_cfg_scale(server: Served) -> None:
    """`guidance_scale` is QwenImagePipeline's true_cfg_scale, and left out it is the
    pipeline's own default: each served image is diffusers' for the same seed within one
    uint8 step (and the two scales give images further apart than that)."""
    # Random weights at two steps move little with the scale: 50 moves pixels by ~14 levels.
    given = npy_of(server, guidance_scale=50.0)
    default = npy_of(server)
    expected_given = qwen_image_pipeline(true_cfg_scale=50.0)
    expected_default = qwen_image_pipeline()
    assert int(np.abs(expected_given.astype(int) - expected_default.astype(int)).max()) > 4
    assert int(np.abs(given.astype(int) - expected_given.astype(int)).max()) <= 1
    assert int(np.abs(default.astype(int) - expected_default.astype(int)).max()) <= 1


@pytest.mark.parametrize("frames", [5, 2, 81])
def test_frames_other_than_one_is_a_422_naming_the_field(server: Served, frames: int) -> None:
    """Any `frames` but 1 on an image model is a 422 whose one error names `frames` and says
    why; no rank runs it, and the server keeps serving."""
    reply = post(server, frames=frames)
    assert reply.status_code == 422, reply.text
    (error,) = reply.json()["detail"]
    assert error["loc"] == ["body", "frames"]
    assert error["msg"] == (
        f"frames must be 1 or left out for {MODEL}, an image model, not {frames}"
    )
    started = [e for e in journal_events(server.db) if e.kind == "request_started"]
    assert all(e.event.shape.frames == 1 for e in started)  # type: ignore[attr-defined]
    assert post(server).status_code == 200


def test_a_json_reply_summarises_the_one_frame_request(server: Served) -> None:
    """response_format json (the default) is the request's summary: one frame of the width
    and height asked for, at the model's own true CFG scale when none is given."""
    reply = post(server)
    assert reply.status_code == 200, reply.text
    summary = reply.json()
    assert summary["request_id"] == reply.headers["x-request-id"]
    assert (summary["width"], summary["height"], summary["frames"]) == (48, 32, 1)
    assert summary["guidance_scale"] == 4.0


def test_boot_tiny_qwen_image_reaches_ready_and_journals_its_run(tmp_path: Path) -> None:
    """`lifecycle boot --model tiny-qwen-image` exits 0 on CPU, and the journal's run is that
    model, an image model, warmed at its one-frame shape, through ready to stopped."""
    done = run_cli("lifecycle", ["boot", "--model", MODEL, "--db", "j.db"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "startup to ready" in done.stdout
    journal = Journal.open_for_read(str(tmp_path / "j.db"))
    (run,) = journal.runs()
    events = list(journal.read(run_id=run.run_id))
    journal.close()
    model = run.config["model"]
    assert (model["name"], model["task"], model["default_frames"]) == (MODEL, "text-to-image", 1)
    path = [e.event.dest for e in events if isinstance(e.event, Transition)]
    assert path[-2:] == ["ready", "stopped"]
    (warmup,) = [e.event for e in events if isinstance(e.event, WarmupRecord)]
    assert (warmup.shape.width, warmup.shape.height, warmup.shape.frames) == (128, 128, 1)
    assert {s.name for s in warmup.stages} == {"text_encoder", "transformer", "vae"}


def test_tiny_qwen_image_without_the_diffusers_extra_is_one_line(tmp_path: Path) -> None:
    """Without diffusers installed, `--model tiny-qwen-image` is one line naming the extra to
    install, exit 2, and no journal is written."""
    done = run_cli(
        "lifecycle", ["boot", "--model", MODEL, "--db", "j.db"], cwd=tmp_path,
        env=without_diffusers(tmp_path), timeout=120,
    )  # fmt: skip
    assert_refused_before_start(
        done, "pip install 'diffusion-lifecycle[diffusers]'", tmp_path / "j.db"
    )


def test_the_built_in_spec_is_its_saved_directorys_but_for_its_default_request(
    tmp_path: Path,
) -> None:
    """tiny-qwen-image's spec is what its directory, saved by diffusers, reads as, but for its
    name, source and small default request: the same grid, heads, true CFG scale and memory
    per token and per pixel (what admission predicts a request's peak with)."""
    from lifecycle.adapters.diffusers import built_in_spec, spec_for_directory

    tiny_qwen_image().save_pretrained(str(tmp_path / "saved"))
    saved = spec_for_directory(str(tmp_path / "saved"))
    built_in = built_in_spec(MODEL)
    assert dataclasses.replace(
        saved, name=MODEL, source=None, source_digest="", default_width=128,
        default_height=128, default_steps=20,
    ) == built_in  # fmt: skip


@pytest.mark.parametrize("command", ["boot", "serve"])
def test_help_lists_every_built_in_model(tmp_path: Path, command: str) -> None:
    """`--help` of boot and serve names every model `--model` builds without files: the
    presets, tiny-wan and tiny-qwen-image."""
    from lifecycle.adapters.diffusers.families import BUILT_INS

    done = run_cli(
        "lifecycle", [command, "--help"], cwd=tmp_path, env={"COLUMNS": "1000"}, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (model_help,) = [s for s in done.stdout.splitlines() if s.lstrip().startswith("--model NAME")]
    for name in (*MODEL_PRESETS, *BUILT_INS):
        assert name in model_help, name


def test_a_missing_encoder_library_is_a_one_line_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where Pillow (PyAV) cannot be imported, png (mp4) is refused, as the server does before
    a request runs, in one line naming the library and the extra that brings it; npy needs
    nothing more."""
    from lifecycle.adapters.diffusers.qwen.qwenspec import qwen_image_spec

    spec = qwen_image_spec(
        name=MODEL, source=None, digest="", transformer={}, vae_scale_factor=8, defaults={}
    )
    assert format_refusal(spec, "png") is None
    monkeypatch.setitem(sys.modules, "PIL", None)
    assert format_refusal(spec, "png") == (
        "response_format png needs Pillow, in the diffusers extra:"
        " pip install 'diffusion-lifecycle[diffusers]'"
    )
    video = MODEL_PRESETS["micro-video"]
    monkeypatch.setitem(sys.modules, "av", None)
    assert format_refusal(video, "mp4") == (
        "response_format mp4 needs PyAV, in the diffusers extra:"
        " pip install 'diffusion-lifecycle[diffusers]'"
    )
    assert format_refusal(video, "npy") is None
