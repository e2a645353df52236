"""The tiny pipelines' decoder, and decoding a video with a decoder residency: latent frames at
once, and spatial tiles."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle.core.format.records import Shape
from lifecycle.runtime.pipeline.placement import DecoderResidency
from lifecycle.runtime.pipeline.tinyconfig import TinyConfig


class Decoder(nn.Module):
    """A VAE-style decoder: latent frames to pixels by convolution and depth-to-space."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        s, hidden = cfg.vae_spatial, cfg.vae_hidden
        self.cfg = cfg
        self.conv_in = nn.Conv2d(cfg.latent_channels, hidden, 3, padding=1)
        self.conv_mid = nn.Conv2d(hidden, hidden, 3, padding=1)
        self.first_frame = nn.Conv2d(hidden, 3 * s * s, 1)
        self.later_frames = nn.Conv2d(hidden, 3 * cfg.vae_temporal * s * s, 1)

    def features(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent frames (B, C, h, w) to hidden features (each output pixel sees 2 latents out)."""
        return F.silu(self.conv_mid(F.silu(self.conv_in(latent))))

    def pixels(self, features: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Features (B, hidden, h, w) to pixel frames (B, F, 3, h*s, w*s) in [-1, 1]."""
        head = self.first_frame if first else self.later_frames
        pixels = F.pixel_shuffle(head(features), self.cfg.vae_spatial)  # (B, 3*F, h*s, w*s)
        b, cf, hh, ww = pixels.shape
        return torch.tanh(pixels.view(b, cf // 3, 3, hh, ww))

    def decode_frame(self, latent: torch.Tensor, *, first: bool) -> torch.Tensor:
        """Latent frames (B, C, h, w) to pixel frames (B, F, 3, h*s, w*s) in [-1, 1]."""
        return self.pixels(self.features(latent), first=first)


# Latent pixels a tile reads beyond its edges: the decoder's two 3x3 convolutions see two out,
# so a tile with this halo decodes exactly what the whole frame would.
TILE_HALO = 2


def _halves(size: int) -> tuple[tuple[int, int], ...]:
    mid = size // 2
    return ((0, mid), (mid, size)) if mid else ((0, size),)


@torch.inference_mode()
def decode_video(
    vae: Decoder, latents: torch.Tensor, shape: Shape, mode: DecoderResidency
) -> torch.Tensor:
    """Decode latents into a uint8 video (frames, height, width, 3): the first latent frame
    alone, the others as many at once as `mode` says, tile by tile."""
    video = torch.empty(
        (shape.frames, shape.height, shape.width, 3), dtype=torch.uint8, device=latents.device
    )
    total = latents.shape[2]
    index = written = 0
    while index < total and written < shape.frames:
        at_once = 1 if index == 0 else (mode.frames_at_once or total)
        chunk = latents[0, :, index : index + at_once].permute(1, 0, 2, 3)
        written = _decode_chunk(vae, video, chunk, first=index == 0, written=written, mode=mode)
        index += chunk.shape[0]
    return video


def _decode_chunk(
    vae: Decoder,
    video: torch.Tensor,
    chunk: torch.Tensor,
    *,
    first: bool,
    written: int,
    mode: DecoderResidency,
) -> int:
    """Decode latent frames (k, C, h, w) into `video` from frame `written`, tile by tile; the
    frames written after them."""
    s = vae.cfg.vae_spatial
    frames_out, height, width, _ = video.shape
    lh, lw = chunk.shape[-2:]
    rows = _halves(lh) if mode.tiles > 1 else ((0, lh),)
    cols = _halves(lw) if mode.tiles > 1 else ((0, lw),)
    count = 0
    for y0, y1 in rows:
        for x0, x1 in cols:
            py1, px1 = min(y1 * s, height), min(x1 * s, width)
            if py1 <= y0 * s or px1 <= x0 * s:
                continue  # a tile wholly in the padding past the video's edge
            ya, yb = max(0, y0 - TILE_HALO), min(lh, y1 + TILE_HALO)
            xa, xb = max(0, x0 - TILE_HALO), min(lw, x1 + TILE_HALO)
            features = vae.features(chunk[:, :, ya:yb, xa:xb])
            features = features[:, :, y0 - ya : y1 - ya, x0 - xa : x1 - xa]
            frames = vae.pixels(features, first=first).flatten(0, 1)
            frames = frames[:, :, : py1 - y0 * s, : px1 - x0 * s]
            count = min(frames.shape[0], frames_out - written)
            pixels = ((frames[:count] + 1.0) * 127.5).clamp_(0, 255).to(torch.uint8)
            video[written : written + count, y0 * s : py1, x0 * s : px1] = pixels.permute(
                0, 2, 3, 1
            )
            del features, frames, pixels
    return written + count
