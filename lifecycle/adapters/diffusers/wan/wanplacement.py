"""The Wan adapter's residency options, diffusers' own knobs: the VAE decodes in spatial tiles
(`AutoencoderKLWan.enable_tiling`) or whole, the text encoder stays resident or is offloaded
between requests (the lifecycle's offloader on CPU: weights written to a file and freed; on
CUDA moved to host memory), and Wan 2.2's two experts stay resident or are swapped
(`experts.py`).

The expected effects are estimated from the decoder's geometry at the request's shape: the VAE
decodes one latent frame at a time (four video frames), its working memory is the full-size
feature maps of that chunk, and the decoded video grows beside it. Tiles shrink the working
memory to the largest tile's, but every decoded tile is held until they are blended, and each
tile is a decoder call of its own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lifecycle.adapters.diffusers.wan.experts import EXPERTS, SWAPPED, ExpertSwap, experts_options
from lifecycle.pipelines import (
    Offloader,
    ResidencyOption,
    Shape,
    reload_seconds,
    resident_or_released,
)

VAE, TEXT_ENCODER = "vae", "text_encoder"
WHOLE, TILED = "whole", "tiled"
RESIDENT, OFFLOADED = "resident", "offloaded"
# What decoding one latent frame holds, in floats per pixel of each video frame it makes:
# WORKING_UNITS per base channel of the decoder and WORKING_FLOOR whatever its width. Fitted to
# the peak RSS growth of WanAdapter.decode measured on CPU (`python -m bench --only diffusers`,
# bench/wanresidency.py, glibc's mmap threshold fixed so that RSS follows the tensors alive):
# tiny-wan's VAE (base_dim 4) held 139 floats a pixel at 128x128x9, 128x128x17, 256x256x17 and
# 832x480x17 alike (34.7, 38.7, 155 and 946 MiB whole), the Wan 2.1 VAE's architecture (base_dim
# 96) 1265 at 256x256x5 (1270 MiB). A decoder of tiny-wan's depth at base_dim 32 held 649, a
# third more than these predict; the video beside such working memory is small enough that the
# tiled/whole ratio, which is what an option declares, moves by a few percent for it.
WORKING_UNITS = 12.24
WORKING_FLOOR = 89.8
# The decoded video (float) alive beside the working memory while the last latent frame
# decodes: the frames decoded so far and their concatenation; 1.21 copies measured with
# tiny-wan's VAE at 128x128 from 9 to 17 frames (36.8 -> 38.7 MiB).
VIDEO_COPIES = 1.25
# A tiled decode ends with every tile, the blended rows, the frame they make and its clamp
# alive: the tiles' share of the video plus about ASSEMBLY_COPIES copies of it.
ASSEMBLY_COPIES = 3.0
# A decoder call's fixed cost, as the pixels it could have decoded in that time: a tiled decode
# makes a call per tile and latent frame where a whole one makes one per latent frame. Fitted
# to tiled/whole decode times on a quiet 2-core CPU (same command, 9 tiles covering 1.56
# frames each time): tiny-wan's VAE 1.80 at 256x256x17 and 1.60 at 832x480x17, the Wan 2.1
# VAE's 1.78-1.95 at 256x256x5; this predicts 1.79, 1.60 and 1.79. Two threads sharing the
# cores with another process slow the many small calls of a tiled decode far more (3.3-3.9
# measured at 256x256x17 under load): the declaration is for a machine the server has alone.
CALL_PIXELS = 45 * 45


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


@dataclass(frozen=True, slots=True)
class TileGrid:
    """The tiles `AutoencoderKLWan.tiled_decode` cuts a frame into: a tile every stride from
    the top left corner on the latent grid, each a tile long or cut short at the edge."""

    rows: tuple[int, ...]  # their heights, in pixels, top to bottom
    cols: tuple[int, ...]  # their widths, left to right

    @classmethod
    def of(cls, shape: Shape, tiling: Tiling, spatial: int) -> TileGrid | None:
        """The grid at `shape`; None when the frame fits in one tile (decoded whole)."""
        tile_h, tile_w, stride_h, stride_w = (side // spatial for side in tiling)
        height, width = shape.height // spatial, shape.width // spatial
        if height <= tile_h and width <= tile_w:
            return None

        def sides(length: int, tile: int, stride: int) -> tuple[int, ...]:
            return tuple(min(tile, length - at) * spatial for at in range(0, length, stride))

        return cls(rows=sides(height, tile_h, stride_h), cols=sides(width, tile_w, stride_w))

    @property
    def tiles(self) -> int:
        return len(self.rows) * len(self.cols)

    @property
    def covered_pixels(self) -> int:
        """Every tile's pixels, the overlaps counted as often as they are decoded."""
        return sum(self.rows) * sum(self.cols)

    @property
    def largest_pixels(self) -> int:
        return max(self.rows) * max(self.cols)


def _vae_tiled(vae: Any, shape: Shape, tiling: Tiling) -> ResidencyOption:
    """The tiled VAE's peak and time against decoding whole, at `shape`."""
    config = vae.config
    base = int(config.get("decoder_base_dim") or config["base_dim"])
    temporal = int(config.get("scale_factor_temporal") or 4)
    # Qwen-Image's VAE (Wan's, for images) names no scale factors: 2 per temporal stage.
    downsamples = len(config.get("temperal_downsample") or (0, 0, 0))
    grid = TileGrid.of(shape, tiling, int(config.get("scale_factor_spatial") or 2**downsamples))
    if grid is None:
        return ResidencyOption(component=VAE, name=TILED, peak_scale=1.0, time_scale=1.0)
    frame = shape.height * shape.width
    video = shape.frames * frame * 3 * 4

    def working(pixels: int) -> float:
        return (WORKING_UNITS * base + WORKING_FLOOR) * temporal * pixels * 4

    covered = grid.covered_pixels / frame
    whole_peak = working(frame) + VIDEO_COPIES * video
    tiled_peak = max(
        working(grid.largest_pixels) + covered * video, (covered + ASSEMBLY_COPIES) * video
    )
    calls = grid.tiles * CALL_PIXELS + grid.covered_pixels
    return ResidencyOption(
        component=VAE,
        name=TILED,
        peak_scale=tiled_peak / whole_peak,
        time_scale=calls / (CALL_PIXELS + frame),
    )


def wan_options(
    pipe: Any, shape: Shape, tiling: Tiling, device: str, experts: Sequence[Any] = ()
) -> tuple[ResidencyOption, ...]:
    """Every option of the Wan adapter, with its expected effect at `shape`; `experts` are
    the transformers a request denoises with (two for Wan 2.2)."""
    encoder = pipe.text_encoder
    encoder_bytes = sum(p.numel() * p.element_size() for p in encoder.parameters())
    return (
        ResidencyOption(component=VAE, name=WHOLE, peak_scale=1.0, time_scale=1.0, reference=True),
        _vae_tiled(pipe.vae, shape, tiling),
        *resident_or_released(
            TEXT_ENCODER,
            released=OFFLOADED,
            released_bytes=encoder_bytes,
            reload_s=reload_seconds(encoder_bytes, device),
        ),
        *experts_options(experts, device),
    )


class WanResidency:
    """Applies the chosen options to the pipeline's own components."""

    def __init__(
        self, pipe: Any, device: torch.device, tiling: Tiling, experts: Sequence[Any] = ()
    ) -> None:
        self._pipe = pipe
        self.tiling = tiling
        self._offloader = Offloader(pipe.text_encoder, device)
        self._kept = _unsaved_buffers(pipe.text_encoder)
        weakref.finalize(self, self._offloader.close)  # no offload file outlives the process
        self._offload = False
        self.experts = ExpertSwap(experts, device)

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
            self._restore_text_encoder()
        self.experts.apply(swapped=chosen.get(EXPERTS) == SWAPPED)

    @contextlib.contextmanager
    def text_encoder_in_use(self) -> Iterator[None]:
        """The text encoder's weights resident while inside; offloaded again after when the
        plan says so."""
        self._restore_text_encoder()
        try:
            yield
        finally:
            if self._offload:
                self._offloader.offload()

    def _restore_text_encoder(self) -> None:
        """Its weights back, and the buffers a state dict leaves out (a rotary table's
        inverse frequencies), which offloading to a file left empty."""
        if not self._offloader.offloaded:
            return
        self._offloader.restore()
        module = self._pipe.text_encoder
        for name, tensor in self._kept.items():
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner)._buffers[leaf] = tensor


def _unsaved_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's non-persistent buffers, by name: what its state dict does not hold."""
    saved = set(module.state_dict())
    return {name: b for name, b in module.named_buffers() if name not in saved}
