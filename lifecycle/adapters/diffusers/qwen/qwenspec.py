"""What the lifecycle knows of a Qwen-Image directory before any rank loads it: its spec (an
image model: QwenImagePipeline's call defaults, its 16-pixel grid and heads), and one line
naming the component for a directory it cannot run (a guidance-distilled transformer, a
tokenizer that does not make the pipeline's prompt template)."""

from __future__ import annotations

import re
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.adapters.diffusers.specs import call_defaults, components_memory, positive_int
from lifecycle.pipelines import DIFFUSERS_COMPONENTS_BACKEND, ConfigError, ModelSpec

# QwenImagePipeline's default image side: default_sample_size latent pixels at its VAE's scale.
DEFAULT_SAMPLE_SIZE = 128
# The VAE's base channels when its config does not say (Qwen-Image's own).
DEFAULT_BASE_DIM = 96
SPECIAL_TOKEN = re.compile(r"<\|[^|]+\|>")


def qwen_image_spec(
    *, name: str, source: str | None, digest: str, transformer: dict[str, Any],
    vae_scale_factor: int, defaults: dict[str, Any], vae_base_dim: int = DEFAULT_BASE_DIM,
) -> ModelSpec:  # fmt: skip
    """A Qwen-Image spec: packed 2x2 latent patches on the VAE's grid, one frame, true CFG's
    scale as the request's guidance."""
    side = vae_scale_factor * int(transformer.get("patch_size", 2))
    default_side = DEFAULT_SAMPLE_SIZE * vae_scale_factor
    heads = int(transformer.get("num_attention_heads", 1))
    inner = heads * int(transformer.get("attention_head_dim", 1))
    return ModelSpec(
        name=name,
        task="text-to-image",
        default_width=positive_int(defaults.get("width"), default_side),
        default_height=positive_int(defaults.get("height"), default_side),
        default_frames=1,
        default_steps=positive_int(defaults.get("num_inference_steps"), 50),
        default_guidance_scale=float(defaults.get("true_cfg_scale", 4.0)),
        frame_multiple=1,
        spatial_multiple=side,
        pixels_per_token_side=side,
        frames_per_latent=1,
        attention_heads=heads,
        backend=DIFFUSERS_COMPONENTS_BACKEND,
        declares_residency=True,
        source=source,
        source_digest=digest,
        # The decoded image twice over, plus the decoder's full-size feature maps.
        memory=components_memory(inner=inner, bytes_per_pixel=2 * 3 * 4 + 3 * vae_base_dim * 4),
    )


def read_qwen_image_spec(directory: PipelineDirectory, pipeline_class: Any) -> ModelSpec:
    """A QwenImagePipeline directory's spec; one line naming the component it cannot run."""
    transformer, vae = directory.config("transformer"), directory.config("vae")
    shown = f"--model-path {directory.path}"
    if transformer.get("guidance_embeds"):
        raise ConfigError(
            f"{shown}: transformer is guidance-distilled (guidance_embeds): the lifecycle"
            " drives Qwen-Image with true classifier-free guidance only",
            field="model_path",
        )
    pipe = pipeline_class(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                          transformer=None)  # fmt: skip
    check_template(directory, pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)
    downsamples = vae.get("temperal_downsample") or [False, True, True]
    return qwen_image_spec(
        name=directory.name,
        source=str(directory.path),
        digest=directory.digest,
        transformer=transformer,
        vae_scale_factor=2 ** len(downsamples),
        defaults=call_defaults(pipeline_class),
        vae_base_dim=positive_int(vae.get("base_dim"), DEFAULT_BASE_DIM),
    )


def check_template(directory: PipelineDirectory, template: str, start_idx: int) -> None:
    """The directory's tokenizer makes the pipeline's prompt template as the pipeline drops
    it: each special token of the template one token, and the template's text before the
    prompt exactly `start_idx` tokens; ConfigError naming the tokenizer otherwise."""
    from transformers import AutoTokenizer

    shown = f"--model-path {directory.path}"
    if not directory.has("tokenizer"):
        raise ConfigError(f"{shown}: model_index.json names no tokenizer", field="model_path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory.path / "tokenizer"), local_files_only=True
        )
    except (OSError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"{shown}: tokenizer could not be loaded ({reason})", field="model_path"
        ) from None
    for special in dict.fromkeys(SPECIAL_TOKEN.findall(template)):
        if len(tokenizer(special, add_special_tokens=False).input_ids) != 1:
            raise ConfigError(
                f"{shown}: tokenizer lacks the prompt template's special token {special}",
                field="model_path",
            )
    prefix = template.split("{}", 1)[0]
    count = len(tokenizer(prefix).input_ids)  # as the pipeline calls it
    if count != start_idx:
        raise ConfigError(
            f"{shown}: tokenizer makes the prompt template's text before the prompt {count}"
            f" tokens, where the pipeline drops {start_idx}",
            field="model_path",
        )
