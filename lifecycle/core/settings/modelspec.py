"""Models as the gates and the planner know them: a model's specification (its default request,
its shape rules, its backend, its memory estimate) and the built-in presets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lifecycle.core.format.records import Shape

VISUAL_TASKS = frozenset({"text-to-video", "image-to-video", "text-to-image", "image-to-image"})


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryModel:
    """Linear estimate of the memory one request needs beyond what is already in use: a fixed
    workspace, plus so much per latent token, plus so much per output pixel.

    The built-in models' coefficients come from two peaks that `lifecycle boot --calibrate`
    measured on CPU (linux-vmhwm, growth over the baseline before the request): 117 MiB for
    832x480x17 (520 tokens) and 330 MiB for 1280x720x81 (5040 tokens). The uint8 video is
    3 bytes a pixel; the DiT's activations about 4 KiB a token.
    """

    fixed_bytes: int
    bytes_per_token: int
    bytes_per_pixel: int

    def estimate(self, *, tokens: int, pixels: int) -> int:
        return self.fixed_bytes + self.bytes_per_token * tokens + self.bytes_per_pixel * pixels


# What runs a model (`ModelSpec.backend`): the lifecycle's own code or a plug-in's (NATIVE); a
# diffusers pipeline run as one opaque call (DIFFUSERS: the field's "diffusers backend" gate
# closes calibration for it); a diffusers pipeline whose components the adapter drives.
NATIVE_BACKEND = "native"


DIFFUSERS_BACKEND = "diffusers"


DIFFUSERS_COMPONENTS_BACKEND = "diffusers-components"


LIBRARY_BACKENDS = frozenset({DIFFUSERS_BACKEND, DIFFUSERS_COMPONENTS_BACKEND})


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """What the gates and the planner need to know of a model; the pipeline brings the rest."""

    name: str
    task: str
    default_width: int
    default_height: int
    default_frames: int
    default_steps: int
    frame_multiple: int = 4  # valid frame counts are 1 + frame_multiple * k
    spatial_multiple: int = 16  # width and height are multiples of this
    pixels_per_token_side: int = 64  # VAE and patch compression, per spatial side
    frames_per_latent: int = 4
    attention_heads: int = 4
    supports_residency_calibration: bool = True
    backend: str = NATIVE_BACKEND
    realtime_adapter: bool = False
    # Whether its pipeline declares residency options for the planner (a plug-in opts in).
    declares_residency: bool = False
    default_guidance_scale: float = 5.0  # a request's classifier-free guidance unless given
    # Where a library's pipeline is loaded from (a diffusers directory), and a digest of its
    # configs and weight files: part of the spec, so that new weights are a new fingerprint.
    source: str | None = None
    source_digest: str = ""
    memory: MemoryModel = field(
        default_factory=lambda: MemoryModel(fixed_bytes=0, bytes_per_token=0, bytes_per_pixel=0)
    )

    @property
    def default_shape(self) -> Shape:
        return Shape(
            width=self.default_width, height=self.default_height, frames=self.default_frames
        )

    def tokens(self, shape: Shape) -> int:
        """Latent tokens the DiT attends over for one branch of a request of this shape."""
        side = self.pixels_per_token_side
        latent_frames = (shape.frames - 1) // self.frames_per_latent + 1
        return latent_frames * (-(-shape.height // side)) * (-(-shape.width // side))

    def estimated_peak_bytes(self, shape: Shape) -> int:
        return self.memory.estimate(tokens=self.tokens(shape), pixels=shape.pixels)


TINY_MEMORY = MemoryModel(fixed_bytes=96 * 2**20, bytes_per_token=4 * 2**10, bytes_per_pixel=3)


# The field's video models default to 1280x720x81; tiny-video keeps that request shape and
# compresses hard enough that a calibrated startup fits on two CPU cores.
TINY_VIDEO = ModelSpec(
    name="tiny-video",
    task="text-to-video",
    default_width=1280,
    default_height=720,
    default_frames=81,
    default_steps=50,
    declares_residency=True,
    memory=TINY_MEMORY,
)

MODEL_PRESETS: dict[str, ModelSpec] = {
    "tiny-video": TINY_VIDEO,
    # The same architecture at a small default request, for quick multi-rank runs.
    "micro-video": replace(
        TINY_VIDEO,
        name="micro-video",
        default_width=512,
        default_height=288,
        default_frames=33,
        default_steps=20,
    ),
}
