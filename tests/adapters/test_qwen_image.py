"""Qwen-Image through its adapter: its spec read from the directory, the same image as
QwenImagePipeline with and without true CFG, its residency options, the tiny tokenizer's
template, and one line for a directory it cannot run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.pipelinedirs import save_tiny_qwen_image
from lifecycle.adapters.diffusers import built_in_spec, spec_for_directory
from lifecycle.adapters.diffusers.qwen.tinyqwen import tiny_qwen_tokenizer
from lifecycle.core.errors import ConfigError
from lifecycle.pipelines import DIFFUSERS_COMPONENTS_BACKEND, Shape
from tests.conftest import assert_refused_before_start, run_cli
from tests.support.adapters import adapter_for, adapter_of

SHAPE = Shape(width=48, height=64, frames=1)
PROMPT = "a dog walks in the city at night"
STEPS, SEED = 3, 9


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_image(tmp_path_factory.mktemp("qwen") / "Tiny-Qwen-Image")


def test_the_template_prefix_is_the_pipelines_dropped_tokens() -> None:
    """The tiny tokenizer makes QwenImagePipeline's template text before the prompt exactly
    the 34 tokens the pipeline drops, its special tokens one token each, and any prompt (non-
    ASCII too) decodes back to itself."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None
    )
    tokenizer = tiny_qwen_tokenizer()
    template = pipe.prompt_template_encode
    prefix = template.split("{}")[0]
    assert len(tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    assert all(len(tokenizer(s).input_ids) == 1 for s in ("<|im_start|>", "<|im_end|>"))
    text = "une rue la nuit, 夜の街"
    assert tokenizer.decode(tokenizer(text).input_ids) == text


def test_a_qwen_image_directory_gives_an_image_models_spec(qwen_dir: Path) -> None:
    """The spec comes from the directory: its name, one frame, the packed 16-pixel grid, the
    transformer's heads, QwenImagePipeline's call defaults (1024x1024, 50 steps, true CFG
    4.0), its components driven."""
    spec = spec_for_directory(str(qwen_dir))
    assert (spec.name, spec.task, spec.backend) == (
        "Tiny-Qwen-Image", "text-to-image", DIFFUSERS_COMPONENTS_BACKEND,
    )  # fmt: skip
    assert (spec.default_width, spec.default_height, spec.default_frames) == (1024, 1024, 1)
    assert (spec.default_steps, spec.default_guidance_scale) == (50, 4.0)
    assert (spec.spatial_multiple, spec.frame_multiple, spec.attention_heads) == (16, 1, 4)
    assert spec.declares_residency


def reference(path: Path, negative: str | None, scale: float) -> np.ndarray:
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(str(path), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = pipe(
        prompt=PROMPT, negative_prompt=negative, true_cfg_scale=scale, height=SHAPE.height,
        width=SHAPE.width, num_inference_steps=STEPS,
        generator=torch.Generator("cpu").manual_seed(SEED), output_type="np",
    ).images  # fmt: skip
    return np.clip(np.round(images * 255.0), 0, 255).astype(np.uint8)


def generate(adapter: Any, negative: str, scale: float) -> np.ndarray:
    embeds = adapter.encode_prompt(PROMPT, negative)
    latents = adapter.denoise(
        embeds, SHAPE, STEPS, seed=SEED, guidance_scale=scale, on_step=lambda _: None
    )
    return adapter.decode(latents, SHAPE).numpy()  # type: ignore[no-any-return]


@pytest.mark.usefixtures("models_forgotten")
def test_the_adapter_makes_qwen_image_pipelines_image(qwen_dir: Path) -> None:
    """With the same seed the adapter's image is QwenImagePipeline's within one uint8 step:
    with true CFG and a negative prompt, without a negative prompt (no guidance, as the
    pipeline), and with the text encoder offloaded between requests."""
    adapter = adapter_of(qwen_dir)
    guided = reference(qwen_dir, "blurry, dark", 4.0)
    unguided = reference(qwen_dir, None, 4.0)
    assert not np.array_equal(guided, unguided)
    for negative, expected in (("blurry, dark", guided), ("", unguided)):
        image = generate(adapter, negative, 4.0)
        assert image.shape == expected.shape == (1, 64, 48, 3)
        assert int(np.abs(image.astype(int) - expected.astype(int)).max()) <= 1
    options = {(o.component, o.name): o for o in adapter.residency_options(SHAPE)}
    assert set(options) == {
        ("vae", "whole"), ("vae", "tiled"), ("text_encoder", "resident"),
        ("text_encoder", "offloaded"),
    }  # fmt: skip
    adapter.apply_residency([options[("vae", "whole")], options[("text_encoder", "offloaded")]])
    image = generate(adapter, "blurry, dark", 4.0)
    assert int(np.abs(image.astype(int) - guided.astype(int)).max()) <= 1


@pytest.mark.usefixtures("models_forgotten")
def test_tiny_qwen_image_is_built_in_and_makes_its_saved_directorys_image(qwen_dir: Path) -> None:
    """The built-in tiny-qwen-image (no files: seeded weights built at start) has a small
    default request, and the pipeline the lifecycle builds for it makes the same image as the
    directory it saves, through QwenImagePipeline."""
    spec = built_in_spec("tiny-qwen-image")
    assert (spec.name, spec.source, spec.default_shape) == (
        "tiny-qwen-image", None, Shape(width=128, height=128, frames=1),
    )  # fmt: skip
    adapter = adapter_for(spec)
    image = generate(adapter, "blurry, dark", 4.0)
    expected = reference(qwen_dir, "blurry, dark", 4.0)
    assert int(np.abs(image.astype(int) - expected.astype(int)).max()) <= 1


def damaged(source: Path, target: Path, damage: str) -> Path:
    shutil.copytree(source, target)
    if damage == "distilled":
        config_path = target / "transformer/config.json"
        config = json.loads(config_path.read_text())
        config["guidance_embeds"] = True
        config_path.write_text(json.dumps(config))
    elif damage == "no-specials":
        tokenizer_path = target / "tokenizer/tokenizer.json"
        doc = json.loads(tokenizer_path.read_text())
        doc["added_tokens"] = [t for t in doc["added_tokens"] if t["content"] != "<|im_start|>"]
        tokenizer_path.write_text(json.dumps(doc))
    elif damage == "long-template":
        tokenizer_path = target / "tokenizer/tokenizer.json"
        doc = json.loads(tokenizer_path.read_text())
        doc["model"]["merges"] = [m for m in doc["model"]["merges"] if m != ["Ġdetailin", "g"]]
        tokenizer_path.write_text(json.dumps(doc))
    return target


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        ("distilled", "transformer is guidance-distilled (guidance_embeds)"),
        ("no-specials", "tokenizer lacks the prompt template's special token <|im_start|>"),
        ("long-template", "tokenizer makes the prompt template's text before the prompt 35"),
    ],
)
def test_a_directory_qwen_image_cannot_run_is_one_line_naming_the_component(
    qwen_dir: Path, tmp_path: Path, damage: str, says: str
) -> None:
    """A guidance-distilled transformer, a tokenizer without the template's special tokens,
    or one that makes the template's prefix another length than the pipeline drops: one
    ConfigError naming the component."""
    with pytest.raises(ConfigError) as raised:
        spec_for_directory(str(damaged(qwen_dir, tmp_path / "d", damage)))
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_a_tokenizer_without_the_templates_tokens_stops_the_launch(
    qwen_dir: Path, tmp_path: Path
) -> None:
    """`lifecycle boot` on two ranks of a directory whose tokenizer lacks <|im_start|>: one
    line naming the tokenizer, exit 2, no journal written (no rank started)."""
    target = damaged(qwen_dir, tmp_path / "d", "no-specials")
    done = run_cli(
        "lifecycle", ["boot", "--model-path", str(target), "--num-ranks", "2", "--cfg-parallel",
                      "2", "--db", "j.db"],
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert_refused_before_start(
        done, "tokenizer lacks the prompt template's special token", tmp_path / "j.db"
    )
