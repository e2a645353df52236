"""What the lifecycle knows of a diffusers pipeline before any rank loads it: its ModelSpec,
read from the directory's configs and the pipeline class's own call defaults."""

from __future__ import annotations

import inspect
from typing import Any

from lifecycle.adapters.diffusers.directory import PipelineDirectory
from lifecycle.pipelines import (
    DIFFUSERS_BACKEND,
    DIFFUSERS_COMPONENTS_BACKEND,
    MAX_STEPS,
    MemoryModel,
    ModelSpec,
)

# The Wan adapter drives these classes' components itself (CFG-parallel, Ulysses, residency);
# any other pipeline class runs on one rank through its own __call__.
ADAPTED = frozenset({"WanPipeline"})
# `backend` of a ModelSpec: the field's gate closes calibration for a pipeline run as one
# opaque call (DIFFUSERS) and passes for one whose components the adapter drives.
DIFFUSERS = DIFFUSERS_BACKEND
DIFFUSERS_COMPONENTS = DIFFUSERS_COMPONENTS_BACKEND
FALLBACK_SIDE = 512  # a call default of None (the pipeline derives it from its configs)


def call_defaults(pipeline_class: Any) -> dict[str, Any]:
    """The defaults of the pipeline class's __call__ that a request's shape and steps use."""
    try:
        parameters = inspect.signature(pipeline_class.__call__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in parameters.items() if p.default is not p.empty}


def _int(value: Any, fallback: int) -> int:
    return (
        value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else fallback
    )


def wan_spec(
    *, name: str, source: str | None, digest: str, pipe_configs: dict[str, dict[str, Any]],
    defaults: dict[str, Any],
) -> ModelSpec:  # fmt: skip
    """A Wan directory's (or tiny-wan's) spec: its grid from the VAE and the transformer's
    patch, its heads, WanPipeline's call defaults, and what its memory grows with."""
    vae, transformer = pipe_configs["vae"], pipe_configs["transformer"]
    temporal = _int(vae.get("scale_factor_temporal"), 4)
    spatial = _int(vae.get("scale_factor_spatial"), 8)
    patch = transformer.get("patch_size") or (1, 2, 2)
    side = spatial * int(patch[1])
    inner = int(transformer.get("num_attention_heads", 1)) * int(
        transformer.get("attention_head_dim", 1)
    )
    base = int(vae.get("decoder_base_dim") or vae.get("base_dim") or 96)
    return ModelSpec(
        name=name,
        task="text-to-video",
        default_width=_int(defaults.get("width"), 832),
        default_height=_int(defaults.get("height"), 480),
        default_frames=_int(defaults.get("num_frames"), 81),
        default_steps=_int(defaults.get("num_inference_steps"), 50),
        default_guidance_scale=float(defaults.get("guidance_scale", 5.0)),
        frame_multiple=temporal,
        spatial_multiple=side,
        pixels_per_token_side=side,
        frames_per_latent=temporal,
        attention_heads=int(transformer.get("num_attention_heads", 1)),
        backend=DIFFUSERS_COMPONENTS,
        declares_residency=True,
        source=source,
        source_digest=digest,
        memory=MemoryModel(
            fixed_bytes=0,
            # Activations of a token through a block: a few copies of its hidden state, float.
            bytes_per_token=16 * inner * 4,
            # The decoded video twice over, plus the decoder's full-size feature maps.
            bytes_per_pixel=2 * 3 * 4 + 3 * base * 4 // temporal,
        ),
    )


def generic_spec(directory: PipelineDirectory, pipeline_class: Any) -> ModelSpec:
    """Any other pipeline class: its own call's defaults, run as one opaque call."""
    defaults = call_defaults(pipeline_class)
    video = "num_frames" in defaults
    return ModelSpec(
        name=directory.name,
        task="text-to-video" if video else "text-to-image",
        default_width=_int(defaults.get("width"), FALLBACK_SIDE),
        default_height=_int(defaults.get("height"), FALLBACK_SIDE),
        default_frames=_int(defaults.get("num_frames"), 1),
        # A call's default steps past what a request may ask for (DDPM's 1000) are capped.
        default_steps=min(_int(defaults.get("num_inference_steps"), 50), MAX_STEPS),
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
