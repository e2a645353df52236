"""A Wan pipeline directory served through the lifecycle: its output equals diffusers' own
`WanPipeline` for the same seed, on one rank, with CFG-parallel 2 and with Ulysses 2 (real
rank processes on gloo), and every all-to-all and gather it makes is journaled."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from bench.pipelinedirs import save_small_wan
from tests.support import families, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

REQUEST = families.WAN_REQUEST


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan(tmp_path_factory.mktemp("wan") / "small-wan", scheduler="unipc")


@pytest.fixture(scope="module")
def diffusers_video(wan_dir: Path) -> np.ndarray:
    """What diffusers' own WanPipeline makes of REQUEST, scaled to uint8."""
    return families.wan_pipeline_video(wan_dir, REQUEST)


@pytest.mark.parametrize("layout", families.LAYOUTS)
def test_served_video_equals_wan_pipeline_within_one_step(
    tmp_path: Path, wan_dir: Path, diffusers_video: np.ndarray, layout: tuple[str, ...]
) -> None:
    """POST /generate with response_format npy on a served directory gives WanPipeline's video
    for the same seed, within one uint8 step everywhere, under the request id it was given."""
    events = families.assert_served_within_one_step(
        tmp_path, wan_dir, layout, REQUEST, diffusers_video, headers={"X-Request-ID": "wan-req-1"}
    )
    started = [e for e in events if e.kind == "request_started"]
    assert {e.event.request_id for e in started} == {"wan-req-1"}  # type: ignore[attr-defined]
    assert {(e.event.seed, e.event.guidance_scale) for e in started} == {(11, 4.5)}  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_fields_failure_on_a_wan_pipeline_is_diagnosed_with_the_all_to_all_named(
    tmp_path: Path,
) -> None:
    """tiny-wan on 4 ranks, rank 1 raising in drop-buffers (see
    assert_the_fields_failure_is_diagnosed)."""
    families.assert_the_fields_failure_is_diagnosed(
        tmp_path, "--model", "tiny-wan", "--default-shape", "64x64x33"
    )


def test_an_mp4_reply_holds_the_video_and_bad_fields_are_422_naming_them(
    tmp_path: Path, wan_dir: Path
) -> None:
    """response_format mp4 is an H.264 MP4 of the request's frames (decoded back with PyAV);
    a response format, guidance scale, seed, negative prompt or request id that cannot be is a
    422 naming the field."""
    import av

    with serve(tmp_path, "--model-path", str(wan_dir), *families.QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post(
            "/generate", json={**REQUEST, "response_format": "mp4"}, timeout=240
        )
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"] == "video/mp4"
        with av.open(io.BytesIO(reply.content)) as container:
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == 9 and frames[0].shape == (32, 48, 3)
        bad = {
            "response_format": "gif",
            "guidance_scale": -1.0,
            "seed": -5,
            "negative_prompt": "x" * 5000,
        }
        for field, value in bad.items():
            refused = server.client.post("/generate", json={**REQUEST, field: value})
            assert refused.status_code == 422, (field, refused.text)
            assert refused.json()["detail"][0]["loc"] == ["body", field]
        refused = server.client.post(
            "/generate", json=REQUEST, headers={"X-Request-ID": "../etc/passwd"}
        )
        assert refused.status_code == 422
        assert refused.json()["detail"][0]["loc"] == ["header", "x-request-id"]
        assert server.stop() == 0
