"""A Qwen-Image directory served through the lifecycle: its image equals diffusers' own
`QwenImagePipeline` for the same seed (true CFG with a negative prompt), on one rank, with
CFG-parallel 2 and with Ulysses 2 (real rank processes on gloo)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.pipelinedirs import save_tiny_qwen_image
from tests.support import families

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

REQUEST = families.family_request(
    "48x64x1",
    prompt="a cat walks in the rain at night",
    negative_prompt="blurry, dark",
    steps=3,
    guidance_scale=3.5,
    seed=13,
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_image(tmp_path_factory.mktemp("qwen") / "tiny-qwen-image-dir")


@pytest.fixture(scope="module")
def diffusers_image(qwen_dir: Path) -> np.ndarray:
    """What diffusers' own QwenImagePipeline makes of REQUEST, scaled to uint8."""
    return families.qwen_image_pipeline_image(qwen_dir, REQUEST)


@pytest.mark.parametrize("layout", families.LAYOUTS)
def test_served_image_equals_qwen_image_pipeline_within_one_step(
    tmp_path: Path, qwen_dir: Path, diffusers_image: np.ndarray, layout: tuple[str, ...]
) -> None:
    """POST /generate (npy) on a served Qwen-Image directory, guidance_scale as its
    true_cfg_scale, gives QwenImagePipeline's image for the same seed as one frame, within one
    uint8 step everywhere; every rank journals the request it ran."""
    families.assert_served_within_one_step(tmp_path, qwen_dir, layout, REQUEST, diffusers_image)


@pytest.mark.slow
def test_the_fields_failure_on_a_qwen_image_directory_is_diagnosed_with_the_all_to_all_named(
    tmp_path: Path, qwen_dir: Path
) -> None:
    """A Qwen-Image directory on 4 ranks, rank 1 raising in drop-buffers (see
    assert_the_fields_failure_is_diagnosed)."""
    families.assert_the_fields_failure_is_diagnosed(
        tmp_path, "--model-path", str(qwen_dir), "--default-shape", "128x128x1",
        "--default-steps", "4",
    )  # fmt: skip
