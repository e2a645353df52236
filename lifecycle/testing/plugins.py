"""A minimal plug-in pipeline on `lifecycle.pipelines` alone, and the check a plug-in author
runs on their own: the protocol, then one tiny request through the pipeline in this process.

`lifecycle boot --pipeline lifecycle.testing.plugins:PLUGIN` boots `MinimalPipeline` on CPU
at any number of ranks; `check_plugin(PLUGIN)` is what a plug-in's own test calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lifecycle.pipelines import (
    Comm,
    ConfigError,
    Generation,
    MemoryModel,
    ModelSpec,
    Pipeline,
    PipelineFactory,
    Shape,
    memory_meter,
)
from lifecycle.runtime.pipeline.conformance import PIPELINE, check_factory, conform
from lifecycle.runtime.request import Generated, run_request

LATENT_CHANNELS = 4
TEXT_DIM = 16
PIXELS_PER_LATENT = 8  # each latent cell decodes to an 8x8 patch of every frame

SPEC = ModelSpec(
    name="minimal-video",
    task="text-to-video",
    default_width=64,
    default_height=64,
    default_frames=5,
    default_steps=2,
    memory=MemoryModel(fixed_bytes=16 * 2**20, bytes_per_token=1024, bytes_per_pixel=3),
)


class MinimalPipeline:
    """A text encoder over the prompt's bytes, a denoiser of a few convolutions guided by it,
    and a decoder to uint8 frames; its latents are averaged over the world group, so that a run
    of several ranks records a collective per step."""

    components: tuple[str, ...] = ("text_encoder", "denoiser", "decoder")

    def __init__(self, spec: ModelSpec, comm: Comm) -> None:
        self.spec = spec
        self.comm = comm
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # every rank builds the same weights
            self.text_encoder = nn.EmbeddingBag(256, TEXT_DIM, mode="mean")
            self.to_bias = nn.Linear(TEXT_DIM, LATENT_CHANNELS)
            self.denoiser = nn.Sequential(
                nn.Conv3d(LATENT_CHANNELS, 8, 3, padding=1),
                nn.SiLU(),
                nn.Conv3d(8, LATENT_CHANNELS, 3, padding=1),
            )
            self.decoder = nn.Conv3d(LATENT_CHANNELS, 3, 1)
        self.weights = nn.ModuleList([self.text_encoder, self.to_bias, self.denoiser, self.decoder])
        self.weights.to(comm.device)

    @property
    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.weights.parameters())

    @torch.no_grad()
    def encode_prompt(self, prompt: str, negative_prompt: str) -> torch.Tensor:
        """The prompt's and the negative prompt's embeddings, stacked."""
        rows = [list(text.encode("utf-8")[:256]) or [0] for text in (prompt, negative_prompt)]
        return torch.cat(
            [self.text_encoder(torch.tensor([row], device=self.comm.device)) for row in rows]
        )

    @torch.no_grad()
    def denoise(
        self,
        embeds: torch.Tensor,
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor:
        """Latents of (1, channels, frames, height/8, width/8), from seeded noise."""
        size = (1, LATENT_CHANNELS, shape.frames, *latent_side(shape))
        generator = torch.Generator().manual_seed(seed)
        latents = torch.randn(size, generator=generator).to(self.comm.device)
        bias = self.to_bias(embeds)[:, :, None, None, None]
        for step in range(steps):
            cond = self.denoiser(latents + bias[0])
            uncond = self.denoiser(latents + bias[1])
            latents = latents - (uncond + guidance_scale * (cond - uncond)) / steps
            # Every rank holds the same latents: the sum over the world is exact, and so is
            # halving it again, so every rank's video has the same checksum.
            self.comm.world.all_reduce(latents, op="sum", purpose="minimal-latents")
            latents = latents / self.comm.world.size
            on_step(step)
        return latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        """The video as uint8 (frames, height, width, 3)."""
        rgb = self.decoder(latents)
        rgb = rgb.repeat_interleave(PIXELS_PER_LATENT, dim=3)
        rgb = rgb.repeat_interleave(PIXELS_PER_LATENT, dim=4)
        rgb = rgb[0, :, :, : shape.height, : shape.width].permute(1, 2, 3, 0)
        return ((torch.tanh(rgb) + 1) * 127.5).round().to(torch.uint8).contiguous()


def latent_side(shape: Shape) -> tuple[int, int]:
    """The latents' height and width for a request of `shape`."""
    return (-(-shape.height // PIXELS_PER_LATENT), -(-shape.width // PIXELS_PER_LATENT))


def minimal_factory(spec: ModelSpec, comm: Comm) -> MinimalPipeline:
    """Build the minimal pipeline on this rank."""
    return MinimalPipeline(spec, comm)


PLUGIN: tuple[ModelSpec, PipelineFactory] = (SPEC, minimal_factory)


def smallest_shape(spec: ModelSpec) -> Shape:
    """The smallest request a spec allows that still has one token a side (and, for a
    video model, more than one frame)."""
    multiple = spec.spatial_multiple
    side = max(multiple, -(-spec.pixels_per_token_side // multiple) * multiple)
    frames = 1 + spec.frame_multiple if "video" in spec.task else 1
    return Shape(width=side, height=side, frames=frames)


def check_plugin(
    plugin: tuple[ModelSpec, Any],
    *,
    shape: Shape | None = None,
    steps: int = 2,
    prompt: str = "a lighthouse in a storm",
) -> Generated:
    """Hold a plug-in's `(ModelSpec, factory)` pair to the pipeline protocol as `--pipeline`
    does, then run one request through the pipeline it builds, as one rank alone on CPU, and
    check what it did: `steps` calls of `on_step`, made as the steps are done, and a uint8
    (frames, height, width, 3) video. Raises ConfigError naming what is wrong; returns the
    request's result and video.
    """
    spec, factory = plugin
    if not isinstance(spec, ModelSpec):
        raise ConfigError(PIPELINE, " must name a (ModelSpec, factory) pair")
    check_factory(spec.name, factory, spec)
    device = torch.device("cpu")
    pipeline: Pipeline = conform(factory(spec, Comm.alone(device)), spec)
    request = Generation(
        prompt=prompt,
        negative_prompt="blurry",
        shape=shape or smallest_shape(spec),
        steps=steps,
        guidance_scale=spec.default_guidance_scale,
        seed=0,
    )
    calls = _TensorCalls()
    steps_seen: list[tuple[int, float]] = []  # at each on_step: tensor calls so far, and when

    def seen(_step: int) -> None:
        steps_seen.append((calls.count, time.perf_counter()))

    with calls:
        generated = run_request(
            pipeline, request, meter=memory_meter(device), device=device, decode=True,
            keep_video=True, after_step=seen,
        )  # fmt: skip
    wrong = _output_gaps(generated, request) + _steps_together(steps_seen, generated)
    if wrong:
        raise ConfigError(PIPELINE, f" {spec.name}: {'; '.join(wrong)}")
    return generated


class _TensorCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods this thread calls while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


# The share of the request's time under which on_step calls with no tensor work between them
# count as made together: an honest step is tensor work, however short; a step of other work
# (numpy, an extension) is still a share of the request that a loop of calls is not.
TOGETHER_SHARE = 0.05


def _steps_together(steps_seen: list[tuple[int, float]], generated: Generated) -> list[str]:
    """Whether denoise made its on_step calls together, before or after its work rather than
    as each step was done, in words: from the tensor calls counted and the time passed at each
    on_step. Time alone would take a long first step (a warm-up) for calls made together;
    counted calls alone, a step done outside torch."""
    if len(steps_seen) < 2:
        return []
    (first_calls, first_at), (last_calls, last_at) = steps_seen[0], steps_seen[-1]
    between_s, total_s = last_at - first_at, generated.result.total_s
    if last_calls > first_calls or between_s >= TOGETHER_SHARE * total_s:
        return []
    return [
        f"denoise called on_step only before or after its work: its {len(steps_seen)} calls"
        f" came together, {between_s * 1e3:.3f} ms from first to last in a request of"
        f" {total_s * 1e3:.1f} ms, with no tensor operation between them; call on_step(step)"
        " as each step is done: the server shows a request's progress, cancels it between"
        " steps and finds it stalled by these calls"
    ]


def _output_gaps(generated: Generated, request: Generation) -> list[str]:
    """What a request's result and video break of the protocol, in words."""
    gaps: list[str] = []
    called = len(generated.result.step_s)
    if called != request.steps:
        gaps.append(f"denoise called on_step {called} times for {request.steps} steps")
    video = generated.video
    shape = request.shape
    want = (shape.frames, shape.height, shape.width, 3)
    if not isinstance(video, torch.Tensor):
        gaps.append(f"decode returned {type(video).__name__}, not a tensor")
    elif video.dtype != torch.uint8:
        gaps.append(f"decode returned {video.dtype}, not torch.uint8")
    elif tuple(video.shape) != want:
        gaps.append(f"decode returned shape {tuple(video.shape)}, not {want} (frames, h, w, 3)")
    return gaps
