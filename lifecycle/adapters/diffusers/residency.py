"""The Wan adapter's residency options, diffusers' own knobs: the VAE decodes in spatial tiles
(`AutoencoderKLWan.enable_tiling`) or whole, and the text encoder stays resident or is
offloaded between requests (the lifecycle's offloader on CPU: weights written to a file and
freed; on CUDA moved to host memory).

The expected effects are estimated from the decoder's geometry at the request's shape: the VAE
decodes one latent frame at a time (four video frames), its working memory is the full-size
feature maps of that chunk, and the decoded video is concatenated as it grows; tiles shrink the
working memory to a tile's share and redo the overlaps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lifecycle.pipelines import Offloader, ResidencyOption, Shape

VAE, TEXT_ENCODER = "vae", "text_encoder"
WHOLE, TILED = "whole", "tiled"
RESIDENT, OFFLOADED = "resident", "offloaded"
# The feature maps alive while one latent frame decodes, in units of (video frames it makes x
# pixels x the decoder's base channels x 4 bytes).
WORKING_UNITS = 3.0
# The decoded video is kept as it grows (torch.cat copies it): about two copies at the end.
VIDEO_COPIES = 2.0
HOST_BYTES_PER_S = 1e9  # writing an offloaded encoder out and reading it back


Tiling = tuple[int, int, int, int]  # tile height, tile width, stride height, stride width


def tile_size(shape: Shape) -> Tiling:
    """Tiles of about half the model's default frame each way, on the VAE's 16-pixel grid,
    overlapping by a quarter: fixed per model, whatever a request's shape."""

    def side(pixels: int) -> tuple[int, int]:
        tile = max(32, (pixels // 2 + 15) // 16 * 16)
        return tile, max(16, tile * 3 // 4 // 16 * 16)

    tile_h, stride_h = side(shape.height)
    tile_w, stride_w = side(shape.width)
    return tile_h, tile_w, stride_h, stride_w


def _tiles(pixels: int, tile: int, stride: int) -> int:
    return max(1, math.ceil(pixels / stride)) if pixels > tile else 1


def wan_options(pipe: Any, shape: Shape, tiling: Tiling) -> tuple[ResidencyOption, ...]:
    """Every option of the Wan adapter, with its expected effect at `shape`."""
    vae = pipe.vae
    base = vae.config.decoder_base_dim or vae.config.base_dim
    temporal = vae.config.scale_factor_temporal or 4
    frame_pixels = shape.height * shape.width
    video = VIDEO_COPIES * shape.frames * frame_pixels * 3 * 4
    working = WORKING_UNITS * temporal * frame_pixels * base * 4
    tile_h, tile_w, stride_h, stride_w = tiling
    rows = _tiles(shape.height, tile_h, stride_h)
    cols = _tiles(shape.width, tile_w, stride_w)
    covered = rows * min(tile_h, shape.height) * cols * min(tile_w, shape.width) / frame_pixels
    per_tile = min(tile_h, shape.height) * min(tile_w, shape.width) / frame_pixels
    tiled_peak = video * covered + working * per_tile
    encoder = pipe.text_encoder
    encoder_bytes = sum(p.numel() * p.element_size() for p in encoder.parameters())
    return (
        ResidencyOption(component=VAE, name=WHOLE, peak_scale=1.0, time_scale=1.0, reference=True),
        ResidencyOption(
            component=VAE,
            name=TILED,
            peak_scale=tiled_peak / (video + working),
            time_scale=covered,
        ),
        ResidencyOption(
            component=TEXT_ENCODER, name=RESIDENT, peak_scale=1.0, time_scale=1.0, reference=True
        ),
        ResidencyOption(
            component=TEXT_ENCODER,
            name=OFFLOADED,
            peak_scale=1.0,
            time_scale=1.0,
            released_bytes=encoder_bytes,
            reload_s=2 * encoder_bytes / HOST_BYTES_PER_S,
        ),
    )


class WanResidency:
    """Applies the chosen options to the pipeline's own components."""

    def __init__(self, pipe: Any, device: torch.device, tiling: Tiling) -> None:
        self._pipe = pipe
        self.tiling = tiling
        self._offloader = Offloader(pipe.text_encoder, device)
        self._offload = False
        self._shape: Shape | None = None

    def apply(self, choices: Sequence[ResidencyOption]) -> None:
        chosen = {o.component: o.name for o in choices}
        vae = self._pipe.vae
        if chosen.get(VAE) == TILED:
            tile_h, tile_w, stride_h, stride_w = self.tiling
            vae.enable_tiling(
                tile_sample_min_height=tile_h,
                tile_sample_min_width=tile_w,
                tile_sample_stride_height=stride_h,
                tile_sample_stride_width=stride_w,
            )
        else:
            vae.disable_tiling()
        self._offload = chosen.get(TEXT_ENCODER) == OFFLOADED
        if self._offload:
            self._offloader.offload()
        else:
            self._offloader.restore()

    @contextlib.contextmanager
    def text_encoder_in_use(self) -> Iterator[None]:
        """The text encoder's weights resident while inside; offloaded again after when the
        plan says so."""
        self._offloader.restore()
        try:
            yield
        finally:
            if self._offload:
                self._offloader.offload()
