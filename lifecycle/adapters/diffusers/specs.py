"""What the lifecycle knows of a diffusers pipeline before any rank loads it: its ModelSpec,
read from the directory's configs and the pipeline class's own call defaults (Wan's, and any
class run through its own call)."""

from __future__ import annotations

import inspect
import math
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.pipelines import (
    DIFFUSERS_BACKEND,
    DIFFUSERS_COMPONENTS_BACKEND,
    MAX_STEPS,
    ConfigError,
    MemoryModel,
    ModelSpec,
)

# `backend` of a ModelSpec: the field's gate closes calibration for a pipeline run as one
# opaque call (DIFFUSERS) and passes for one whose components the adapter drives.
DIFFUSERS = DIFFUSERS_BACKEND
DIFFUSERS_COMPONENTS = DIFFUSERS_COMPONENTS_BACKEND
FALLBACK_SIDE = 512  # a call default of None (the pipeline derives it from its configs)
# What Wan 2.2's two experts must share to denoise the same latents for the same prompt in
# turn, besides their width.
EXPERT_KEYS = ("in_channels", "out_channels", "patch_size", "text_dim")


def call_defaults(pipeline_class: Any) -> dict[str, Any]:
    """The defaults of the pipeline class's __call__ that a request's shape and steps use."""
    try:
        parameters = inspect.signature(pipeline_class.__call__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in parameters.items() if p.default is not p.empty}


def positive_int(value: Any, fallback: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback
    )


def components_memory(*, inner: int, bytes_per_pixel: int) -> MemoryModel:
    """What a pipeline whose components the adapter drives grows with: per token, its
    activations through a transformer block of width `inner` (a few copies of its hidden state,
    float); per output pixel, what its decoder holds."""
    return MemoryModel(
        fixed_bytes=0, bytes_per_token=16 * inner * 4, bytes_per_pixel=bytes_per_pixel
    )


def wan_spec(
    *, name: str, source: str | None, digest: str, pipe_configs: dict[str, dict[str, Any]],
    defaults: dict[str, Any],
) -> ModelSpec:  # fmt: skip
    """A Wan directory's (or tiny-wan's) spec: its grid from the VAE and the transformer's
    patch, its heads, WanPipeline's call defaults, and what its memory grows with."""
    vae, transformer = pipe_configs["vae"], pipe_configs["transformer"]
    # --ulysses must divide the heads of every expert (Wan 2.2 has two).
    heads = math.gcd(
        *(int(c.get("num_attention_heads", 1)) for n, c in pipe_configs.items() if n != "vae")
    )
    temporal = positive_int(vae.get("scale_factor_temporal"), 4)
    spatial = positive_int(vae.get("scale_factor_spatial"), 8)
    patch = transformer.get("patch_size") or (1, 2, 2)
    side = spatial * int(patch[1])
    inner = int(transformer.get("num_attention_heads", 1)) * int(
        transformer.get("attention_head_dim", 1)
    )
    base = int(vae.get("decoder_base_dim") or vae.get("base_dim") or 96)
    return ModelSpec(
        name=name,
        task="text-to-video",
        default_width=positive_int(defaults.get("width"), 832),
        default_height=positive_int(defaults.get("height"), 480),
        default_frames=positive_int(defaults.get("num_frames"), 81),
        default_steps=positive_int(defaults.get("num_inference_steps"), 50),
        default_guidance_scale=float(defaults.get("guidance_scale", 5.0)),
        frame_multiple=temporal,
        spatial_multiple=side,
        pixels_per_token_side=side,
        frames_per_latent=temporal,
        attention_heads=heads,
        backend=DIFFUSERS_COMPONENTS,
        declares_residency=True,
        source=source,
        source_digest=digest,
        # The decoded video twice over, plus the decoder's full-size feature maps.
        memory=components_memory(inner=inner, bytes_per_pixel=2 * 3 * 4 + 3 * base * 4 // temporal),
    )


def read_wan_spec(directory: PipelineDirectory, pipeline_class: Any) -> ModelSpec:
    """A WanPipeline directory's spec, from its VAE's and transformers' configs; one line
    naming the component for a Wan 2.2 directory whose experts cannot run together."""
    configs = {c: directory.config(c) for c in ("vae", "transformer")}
    if check_wan_experts(directory):
        configs["transformer_2"] = directory.config("transformer_2")
    return wan_spec(
        name=directory.name,
        source=str(directory.path),
        digest=directory.digest,
        pipe_configs=configs,
        defaults=call_defaults(pipeline_class),
    )


def check_wan_experts(directory: PipelineDirectory) -> bool:
    """Whether the directory denoises with two experts (Wan 2.2: transformer until
    boundary_ratio, transformer_2 after); ConfigError naming the component when its
    boundary is not a ratio, names no second expert, or the second is unlike the first."""
    shown = f"--model-path {directory.path}"
    ratio = directory.index().get("boundary_ratio")
    if ratio is None:
        return False
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
        raise ConfigError(
            f"{shown}: model_index.json's boundary_ratio {ratio!r} is not a ratio within 0..1"
            " (where transformer_2 takes over from transformer)",
            field="model_path",
        )
    if not directory.has("transformer_2"):
        raise ConfigError(
            f"{shown}: model_index.json's boundary_ratio {ratio} gives the low-noise steps to"
            " transformer_2, which it does not name",
            field="model_path",
        )
    high, low = directory.config("transformer"), directory.config("transformer_2")

    def width(config: dict[str, Any]) -> tuple[int, int, int]:
        heads = int(config.get("num_attention_heads", 0))
        dim = int(config.get("attention_head_dim", 0))
        return heads * dim, heads, dim

    if width(high)[0] != width(low)[0]:
        (wide, heads, dim), (wide_1, heads_1, dim_1) = width(low), width(high)
        raise ConfigError(
            f"{shown}: transformer_2 is {wide} wide ({heads} heads of {dim}), transformer"
            f" {wide_1} ({heads_1} heads of {dim_1}): Wan's two experts must be as wide",
            field="model_path",
        )
    for key in EXPERT_KEYS:
        if high.get(key) != low.get(key):
            raise ConfigError(
                f"{shown}: transformer_2's {key} is {low.get(key)!r}, transformer's"
                f" {high.get(key)!r}: Wan's two experts must take the same latents and prompt",
                field="model_path",
            )
    return True


def generic_spec(directory: PipelineDirectory, pipeline_class: Any) -> ModelSpec:
    """Any other pipeline class: its own call's defaults, run as one opaque call."""
    defaults = call_defaults(pipeline_class)
    video = "num_frames" in defaults
    return ModelSpec(
        name=directory.name,
        task="text-to-video" if video else "text-to-image",
        default_width=positive_int(defaults.get("width"), FALLBACK_SIDE),
        default_height=positive_int(defaults.get("height"), FALLBACK_SIDE),
        default_frames=positive_int(defaults.get("num_frames"), 1),
        # A call's default steps past what a request may ask for (DDPM's 1000) are capped.
        default_steps=min(positive_int(defaults.get("num_inference_steps"), 50), MAX_STEPS),
        default_guidance_scale=float(defaults.get("guidance_scale", 5.0) or 5.0),
        frame_multiple=4 if video else 1,
        spatial_multiple=8,
        pixels_per_token_side=16,
        frames_per_latent=4 if video else 1,
        attention_heads=1,
        backend=DIFFUSERS,
        declares_residency=False,
        source=str(directory.path),
        source_digest=directory.digest,
    )
