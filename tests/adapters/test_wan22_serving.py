"""A Wan 2.2 directory (two experts) served through the lifecycle: its video equals diffusers'
own `WanPipeline` for the same seed, on one rank, with CFG-parallel 2 and with Ulysses 2 (real
rank processes on gloo)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.pipelinedirs import save_small_wan22
from tests.support import families

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

# Timesteps 999 and 857 go to the high-noise expert, 667 and 400 to the low-noise one.
REQUEST = families.family_request(
    "48x32x9",
    prompt="a dog runs on the street at night",
    negative_prompt="blurry, static",
    steps=4,
    guidance_scale=3.5,
    seed=21,
)


@pytest.fixture(scope="module")
def wan22_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_small_wan22(tmp_path_factory.mktemp("wan22") / "small-wan22", boundary_ratio=0.75)


@pytest.fixture(scope="module")
def diffusers_video(wan22_dir: Path) -> np.ndarray:
    """What diffusers' own WanPipeline makes of REQUEST with both experts, scaled to uint8."""
    return families.wan_pipeline_video(wan22_dir, REQUEST)


@pytest.mark.parametrize("layout", families.LAYOUTS)
def test_served_wan22_video_equals_wan_pipeline_within_one_step(
    tmp_path: Path, wan22_dir: Path, diffusers_video: np.ndarray, layout: tuple[str, ...]
) -> None:
    """POST /generate (npy) on a served Wan 2.2 directory gives WanPipeline's video for the
    same seed, both experts denoising in turn, within one uint8 step everywhere; every rank
    journals the request it ran, with its collectives."""
    families.assert_served_within_one_step(tmp_path, wan22_dir, layout, REQUEST, diffusers_video)


@pytest.mark.slow
def test_the_fields_failure_on_a_wan22_directory_is_diagnosed_with_the_all_to_all_named(
    tmp_path: Path, wan22_dir: Path
) -> None:
    """A Wan 2.2 directory on 4 ranks, rank 1 raising in drop-buffers (see
    assert_the_fields_failure_is_diagnosed)."""
    families.assert_the_fields_failure_is_diagnosed(
        tmp_path, "--model-path", str(wan22_dir), "--default-shape", "64x64x9",
        "--default-steps", "4",
    )  # fmt: skip
