"""The residency options of the built-in pipelines: how the decoder is chunked or tiled, and
whether the text encoder stays resident between requests.

On CPU these change the process's peak RSS and time for real: the decoder's working memory
grows with the latent frames it decodes at once and shrinks with spatial tiles, and an
offloaded text encoder's weights are written to a file and freed between requests. On CUDA
offloading moves the weights to host memory between uses (that path has not run on hardware).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lifecycle.core.format.records import ResidencyOption

VAE = "vae"
TEXT_ENCODER = "text_encoder"
FRAMES_ONE = "frames-1"
TILES = "tiles-2x2"
RESIDENT = "resident"
OFFLOADED = "offloaded"
# The decoder's working memory beyond the video, in units of one latent frame's float output
# at full resolution: about 3 of them decoding one latent frame (the head's output, the pixel
# shuffle, tanh and the scaling), and about 2.2 more for each further frame decoded at once
# (peak RSS growth measured on CPU at 1280x720x81 and 832x480x33, `python -m bench --only
# residency`; the smaller shape measures higher, so predictions there err on the safe side).
DECODE_FIRST_FRAME = 3.0
DECODE_EACH_FURTHER_FRAME = 2.2
# Expected time against decoding one latent frame whole, by device type. On CPU (measured on
# 2 cores at 1280x720x81, `python -m bench --only residency`) a smaller working set stays in
# cache: tiles are faster as well as smaller, and every latent frame at once is slower; on
# CUDA (not measured: no GPU here) batching frames is faster and tiles redo the borders.
_FRAMES_TIME = {"cpu": {4: 0.95, 0: 1.24}, "cuda": {4: 0.9, 0: 0.8}}  # 0: all latent frames
_TILES_TIME = {"cpu": 0.45, "cuda": 1.1}
# Offloading on CPU writes the weights to a file and reads them back: its cost is measured
# once per process, by a round trip of this many bytes at most through the same calls (a file
# of the encoder's own size when it is smaller), and scaled to the encoder's bytes: the rate
# depends on the machine's disk and page cache (a round trip of 16 to 768 MiB ran at 0.34 to
# 0.85 GB/s on the 2-core VM the benchmarks ran on, where 1 GB/s had been assumed).
ROUND_TRIP_PROBE_BYTES = 64 * 2**20
# An offload file's two parts: the state dict, and the buffers it leaves out.
STATE, UNSAVED = "state", "unsaved"


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderGeometry:
    """What the decoder's working memory depends on, for one request shape."""

    latent_frames: int
    frame_output_bytes: int  # one latent frame's float output at full resolution
    video_bytes: int  # the uint8 video the request returns

    def working(self, frames_at_once: int, tiles: int = 1) -> float:
        frames = min(frames_at_once, self.latent_frames)
        units = DECODE_FIRST_FRAME + (frames - 1) * DECODE_EACH_FURTHER_FRAME
        return self.video_bytes + units * self.frame_output_bytes / tiles


def frames_option(geometry: DecoderGeometry, frames: int, device: str) -> ResidencyOption:
    """Decode `frames` latent frames at once (0: all of them)."""
    at_once = geometry.latent_frames if frames == 0 else frames
    return ResidencyOption(
        component=VAE,
        name="frames-all" if frames == 0 else f"frames-{frames}",
        peak_scale=geometry.working(at_once) / geometry.working(1),
        time_scale=_FRAMES_TIME[device].get(frames, 1.0),
        reference=frames == 1,
    )


def options_for(
    geometry: DecoderGeometry, encoder_bytes: int, device: str
) -> tuple[ResidencyOption, ...]:
    """Every option of the tiny pipelines, with its expected effect at one shape."""
    kind = "cuda" if device == "cuda" else "cpu"
    return (
        frames_option(geometry, 1, kind),
        frames_option(geometry, 4, kind),
        frames_option(geometry, 0, kind),
        ResidencyOption(
            component=VAE,
            name=TILES,
            peak_scale=geometry.working(1, tiles=4) / geometry.working(1),
            time_scale=_TILES_TIME[kind],
        ),
        *resident_or_released(
            TEXT_ENCODER,
            released=OFFLOADED,
            released_bytes=encoder_bytes,
            reload_s=reload_seconds(encoder_bytes, kind),
        ),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class DecoderResidency:
    """How the decoder runs: latent frames decoded at once (0: all), and spatial tiles."""

    frames_at_once: int = 1
    tiles: int = 1

    @classmethod
    def of(cls, choices: Sequence[ResidencyOption]) -> DecoderResidency:
        name = next((o.name for o in choices if o.component == VAE), FRAMES_ONE)
        if name == TILES:
            return cls(frames_at_once=1, tiles=2)
        count = name.removeprefix("frames-")
        return cls(frames_at_once=0 if count == "all" else int(count), tiles=1)


def resident_or_released(
    component: str, *, released: str, released_bytes: int, reload_s: float
) -> tuple[ResidencyOption, ResidencyOption]:
    """A component's two options: resident (the reference), or `released` (offloaded, swapped):
    `released_bytes` given back between its uses, `reload_s` paid per request to bring them
    back; neither changes the peak's scale or the time's."""
    return (
        ResidencyOption(
            component=component, name=RESIDENT, peak_scale=1.0, time_scale=1.0, reference=True
        ),
        ResidencyOption(
            component=component,
            name=released,
            peak_scale=1.0,
            time_scale=1.0,
            released_bytes=released_bytes,
            reload_s=reload_s,
        ),
    )


_round_trips: dict[int, float] = {}


def reload_seconds(nbytes: int, device: str) -> float:
    """The time an offloaded module of `nbytes` adds to each use: written out and read back
    (on CPU, measured; on CUDA, host memory both ways at PCIe's ~16 GB/s, not measured)."""
    if nbytes <= 0:
        return 0.0
    if device == "cuda":
        return 2 * nbytes / 16e9
    probe = min(nbytes, ROUND_TRIP_PROBE_BYTES)
    if probe not in _round_trips:
        _round_trips[probe] = _round_trip_s(probe)
    return _round_trips[probe] * nbytes / probe


def _round_trip_s(nbytes: int) -> float:
    """One offload and restore of `nbytes` of float weights, as Offloader does them; the
    better of two (the first pays for the file system's first touch)."""
    module = nn.Module()
    module.weight = nn.Parameter(torch.zeros(max(1, nbytes // 4)), requires_grad=False)
    offloader = Offloader(module, torch.device("cpu"))
    best = float("inf")
    try:
        for _ in range(2):
            started = time.perf_counter()
            offloader.offload()
            offloader.restore()
            best = min(best, time.perf_counter() - started)
    finally:
        offloader.close()
    return best


class Offloader:
    """Keeps a module's weights elsewhere between uses: on CUDA in host memory, on CPU in a
    file (so that the process's resident memory really shrinks), and brings them back.

    On CPU the file holds the state dict and the buffers it leaves out (registered with
    persistent=False: a rotary table's frequencies, position ids), so that every parameter and
    buffer comes back, each where it was (a buffer shared by two layers stays shared), and
    while offloaded none of them holds memory."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        self.module = module
        self.device = device
        self._path: str | None = None
        self.offloaded = False

    def offload(self) -> None:
        if self.offloaded:
            return
        if self.device.type == "cuda":
            self.module.to("cpu")
        else:
            fd, path = tempfile.mkstemp(prefix="lifecycle-offload-", suffix=".pt")
            os.close(fd)
            saved = {STATE: self.module.state_dict(), UNSAVED: unsaved_buffers(self.module)}
            torch.save(saved, path)
            self._path = path
            self.module.to_empty(device="meta")
        self.offloaded = True

    def restore(self) -> None:
        if not self.offloaded:
            return
        if self.device.type == "cuda":
            self.module.to(self.device)
        else:
            assert self._path is not None
            saved = torch.load(self._path, map_location=self.device, weights_only=True)
            self.module.load_state_dict(saved[STATE], assign=True)  # no second copy
            for name, tensor in saved[UNSAVED].items():
                owner, _, leaf = name.rpartition(".")
                self.module.get_submodule(owner).register_buffer(leaf, tensor, persistent=False)
            os.unlink(self._path)
            self._path = None
        self.offloaded = False

    def close(self) -> None:
        if self._path is not None:
            os.unlink(self._path)
            self._path = None


def unsaved_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers its state dict leaves out, by every name they have (a buffer two
    submodules share is named by each, as the state dict names a shared weight)."""
    saved = module.state_dict(keep_vars=True)
    return {
        name: buffer
        for name, buffer in module.named_buffers(remove_duplicate=False)
        if name not in saved
    }
