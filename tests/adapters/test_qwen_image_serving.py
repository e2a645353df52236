"""A Qwen-Image directory served through the lifecycle: its image equals diffusers' own
`QwenImagePipeline` for the same seed (true CFG with a negative prompt), on one rank, with
CFG-parallel 2 and with Ulysses 2 (real rank processes on gloo)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.adapters.pipeline_dirs import save_tiny_qwen_image
from tests.support import journal_events, serve

pytestmark = [pytest.mark.ranks, pytest.mark.usefixtures("no_leftover_processes")]

REQUEST = {
    "prompt": "a cat walks in the rain at night",
    "negative_prompt": "blurry, dark",
    "width": 48,
    "height": 64,
    "frames": 1,
    "steps": 3,
    "guidance_scale": 3.5,
    "seed": 13,
}
QUICK = ("--warmup-mode", "none", "--smoke-request", "off", "--dist-timeout", "60")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_image(tmp_path_factory.mktemp("qwen") / "tiny-qwen-image-dir")


@pytest.fixture(scope="module")
def diffusers_image(qwen_dir: Path) -> np.ndarray:
    """What diffusers' own QwenImagePipeline makes of REQUEST, scaled to uint8."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(qwen_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt=REQUEST["prompt"],
        negative_prompt=REQUEST["negative_prompt"],
        true_cfg_scale=REQUEST["guidance_scale"],
        height=REQUEST["height"],
        width=REQUEST["width"],
        num_inference_steps=REQUEST["steps"],
        generator=torch.Generator("cpu").manual_seed(REQUEST["seed"]),
        output_type="np",
    ).images
    return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param((), marks=pytest.mark.slow),
        pytest.param(("--num-ranks", "2", "--cfg-parallel", "2"), marks=pytest.mark.slow),
        ("--num-ranks", "2", "--ulysses", "2"),
    ],
    ids=["1-rank", "cfg-2", "ulysses-2"],
)
def test_served_image_equals_qwen_image_pipeline_within_one_step(
    tmp_path: Path, qwen_dir: Path, diffusers_image: np.ndarray, layout: tuple[str, ...]
) -> None:
    """POST /generate (npy) on a served Qwen-Image directory, guidance_scale as its
    true_cfg_scale, gives QwenImagePipeline's image for the same seed as one frame, within one
    uint8 step everywhere; every rank journals the request it ran."""
    with serve(tmp_path, "--model-path", str(qwen_dir), *layout, *QUICK) as server:
        server.wait_for_health(200, within=240)
        reply = server.client.post(
            "/generate", json={**REQUEST, "response_format": "npy"}, timeout=240
        )
        assert reply.status_code == 200, reply.text
        image = np.load(io.BytesIO(reply.content), allow_pickle=False)
        assert server.stop() == 0
    assert image.shape == diffusers_image.shape == (1, 64, 48, 3)
    assert int(np.abs(image.astype(int) - diffusers_image.astype(int)).max()) <= 1
    finished = [e for e in journal_events(tmp_path / "j.db") if e.kind == "request_finished"]
    assert len(finished) == (1 if not layout else 2)
    assert all(e.event.ok for e in finished)  # type: ignore[attr-defined]
    assert all(e.event.collectives >= (1 if layout else 0) for e in finished)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_fields_failure_on_a_qwen_image_directory_is_diagnosed_with_the_all_to_all_named(
    tmp_path: Path, qwen_dir: Path
) -> None:
    """A Qwen-Image directory on 4 ranks (CFG 2 x Ulysses 2), calibrating, rank 1 raising in
    drop-buffers, its peers waiting as the field's did: `replay diagnose` names rank 1 in
    drop-buffers as the culprit, and the all-to-all of the Ulysses group its peer waits in."""
    import json

    from tests.conftest import run_cli

    booted = run_cli(
        "lifecycle",
        ["boot", "--model-path", str(qwen_dir), "--default-shape", "128x128x1",
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
