"""The sizes of the built-in tiny pipeline's components (runtime.pipeline.tiny), apart from
the modules built from them so that each (the decoder included) imports them alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyConfig:
    latent_channels: int = 8
    dim: int = 128
    heads: int = 4
    layers: int = 4
    mlp_ratio: int = 2
    text_dim: int = 64
    text_layers: int = 2
    text_len: int = 32
    # A hashed byte-bigram table: like a real text encoder's, its weights are the largest a
    # component holds between requests (64 MiB), and so worth offloading when memory is short.
    text_buckets: int = 1 << 18
    patch: int = 2
    vae_spatial: int = 32
    vae_temporal: int = 4
    vae_hidden: int = 32
