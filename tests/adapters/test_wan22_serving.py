"""A Wan 2.2 directory (two experts) served through the lifecycle: its video equals diffusers'
own `WanPipeline` for the same seed, on one rank, with CFG-parallel 2 and with Ulysses 2 (real
rank processes on gloo)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.adapters.pipeline_dirs import save_small_wan22
from tests.support import journal_events, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

# Timesteps 999 and 857 go to the high-noise expert, 667 and 400 to the low-noise one.
REQUEST = {
    "prompt": "a dog runs on the street at night",
    "negative_prompt": "blurry, static",
    "width": 48,
    "height": 32,
    "frames": 9,
    "steps": 4,
    "guidance_scale": 3.5,
    "seed": 21,
}
QUICK = ("--warmup-mode", "none", "--smoke-request", "off", "--dist-timeout", "60")


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan22(tmp_path_factory.mktemp("wan22") / "small-wan22", boundary_ratio=0.75)


@pytest.fixture(scope="module")
def diffusers_video(wan22_dir: Path) -> np.ndarray:
    """What diffusers' own WanPipeline makes of REQUEST with both experts, scaled to uint8."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan22_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt=REQUEST["prompt"],
        negative_prompt=REQUEST["negative_prompt"],
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_frames=REQUEST["frames"],
        num_inference_steps=REQUEST["steps"],
        guidance_scale=REQUEST["guidance_scale"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type="np",
    ).frames[0]
    return np.clip(np.round(frames * 255.0), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((), marks=pytest.mark.slow),
        pytest.param(("--num-ranks", "2", "--cfg-parallel", "2"), marks=pytest.mark.slow),
        ("--num-ranks", "2", "--ulysses", "2"),
    ],
    ids=["1-rank", "cfg-2", "ulysses-2"],
)
def test_served_wan22_video_equals_wan_pipeline_within_one_step(
    tmp_path: Path, wan22_dir: Path, diffusers_video: np.ndarray, layout: tuple[str, ...]
) -> None:
    """POST /generate (npy) on a served Wan 2.2 directory gives WanPipeline's video for the
    same seed, both experts denoising in turn, within one uint8 step everywhere; every rank
    journals the request it ran, with its collectives."""
    with serve(tmp_path, "--model-path", str(wan22_dir), *layout, *QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post(
            "/generate", json={**REQUEST, "response_format": "npy"}, timeout=240
        )
        assert reply.status_code == 200, reply.text
        video = np.load(io.BytesIO(reply.content), allow_pickle=False)
        assert server.stop() == 0
    assert video.shape == diffusers_video.shape == (9, 32, 48, 3)
    assert int(np.abs(video.astype(int) - diffusers_video.astype(int)).max()) <= 1
    finished = [e for e in journal_events(tmp_path / "j.db") if e.kind == "request_finished"]
    ranks = 1 if not layout else 2
    assert len(finished) == ranks
    assert all(e.event.ok for e in finished)  # type: ignore[attr-defined]
    # Across ranks, each step's predictions were gathered (CFG) or its tokens traded (Ulysses).
    assert all(e.event.collectives >= (1 if layout else 0) for e in finished)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_fields_failure_on_a_wan22_directory_is_diagnosed_with_the_all_to_all_named(
    tmp_path: Path, wan22_dir: Path
) -> None:
    """A Wan 2.2 directory on 4 ranks (CFG 2 x Ulysses 2), calibrating, rank 1 raising in
    drop-buffers, its peers waiting as the field's did: `replay diagnose` names rank 1 in
    drop-buffers as the culprit, and the all-to-all of the Ulysses group its peer waits in."""
    import json

    from tests.conftest import run_cli

    booted = run_cli(
        "lifecycle",
        ["boot", "--model-path", str(wan22_dir), "--default-shape", "64x64x9",
         "--default-steps", "4", "--num-ranks", "4", "--cfg-parallel", "2", "--ulysses", "2",
         "--calibrate", "--fault", "1:drop-buffers:raise", "--dist-timeout", "5",
         "--on-peer-failure", "wait", "--db", "j.db", "--log-level", "warning"],
        cwd=tmp_path, timeout=400,
    )  # fmt: skip
    assert booted.returncode == 1, booted.stderr[-2000:]
    done = run_cli("replay", ["diagnose", "latest", "j.db", "--json"], cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert (doc["outcome"], doc["culprit_ranks"], doc["culprit_state"]) == (
        "hung", [1], "drop-buffers",
    )  # fmt: skip
    blocked = {r["rank"]: r["pending_collective"] for r in doc["ranks"] if r["rank"] != 1}
    assert blocked[0]["group"] == "ulysses0" and blocked[0]["op"] == "all_to_all"
