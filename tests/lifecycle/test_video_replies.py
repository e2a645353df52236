"""What a video model's /generate reply may be: npy, mp4 or json, and never png, which is an
image model's (a real `lifecycle serve --model micro-video` on loopback)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tests.support import journal_events, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

QUICK = ("--warmup-mode", "none", "--smoke-request", "off", "--dist-timeout", "60")


def test_png_on_a_video_model_is_a_422_saying_png_is_for_image_models(tmp_path: Path) -> None:
    """On a video model, response_format png is a 422 naming the field and saying png is for
    image models, before any rank runs it; the same request as npy is its frames."""
    with serve(tmp_path, "--num-ranks", "1", *QUICK) as served:
        served.wait_for_health(200, within=120)
        body = {"prompt": "a lighthouse", "width": 64, "height": 64, "frames": 5, "steps": 1}
        reply = served.client.post("/generate", json={**body, "response_format": "png"})
        assert reply.status_code == 422, reply.text
        (error,) = reply.json()["detail"]
        assert error["loc"] == ["body", "response_format"]
        assert error["msg"] == (
            "response_format png is for image models; micro-video makes video (text-to-video):"
            " ask for npy or mp4"
        )
        assert not [e for e in journal_events(served.db) if e.kind == "request_started"]
        npy = served.client.post("/generate", json={**body, "response_format": "npy"})
        assert npy.status_code == 200, npy.text
        assert np.load(io.BytesIO(npy.content), allow_pickle=False).shape == (5, 64, 64, 3)
        assert served.stop() == 0
