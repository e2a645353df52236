"""The Wan adapter: diffusers' own Wan components (UMT5 text encoder, WanTransformer3DModel,
AutoencoderKLWan and the directory's scheduler) driven through the lifecycle's pipeline
protocol, so that its states, records, CFG-parallel and Ulysses groups apply.

With the same seed its output is `WanPipeline`'s: the same prompt encoding, the same latents
from the same generator, the same calls of the transformer (one per branch, batch 1), the same
guidance and scheduler steps, the same decoding. CFG-parallel gives each branch to one rank of
the cfg group and gathers the two predictions through a recorded all-gather; Ulysses shares the
tokens over the ulysses group (`ulysses.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lifecycle.adapters.diffusers.regions import repeated_blocks_of
from lifecycle.adapters.diffusers.wan.wanplacement import WanResidency, tile_size, wan_options
from lifecycle.adapters.diffusers.wan.wanulysses import ulysses_transformer
from lifecycle.pipelines import Comm, ConfigError, ModelSpec, ResidencyOption, Shape

# What WanPipeline.__call__ encodes a prompt to, by default.
MAX_SEQUENCE_LENGTH = 512
COND, UNCOND = "cond", "uncond"


@dataclass(slots=True)
class WanEmbeds:
    """The prompt embeddings of the branches this rank computes, and the texts behind them."""

    texts: dict[str, str]
    embeds: dict[str, torch.Tensor] = field(default_factory=dict)


def cfg_branches(
    comm: Comm, predict: Callable[[str], torch.Tensor], branches: Collection[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The conditional and unconditional predictions of a guided step: both made here, or
    this rank's one branch and its cfg peer's, gathered through the recorded cfg group."""
    if len(branches) == 2:
        return predict(COND), predict(UNCOND)
    (branch,) = branches
    mine = predict(branch).contiguous()
    group = comm.cfg
    both = comm.staging.get(
        purpose="cfg-gather", shape=(group.size, *mine.shape), dtype=mine.dtype, group=group
    )
    group.all_gather(both, mine, purpose="cfg-gather")
    return both[0], both[1]


def require_heads_split(spec: ModelSpec, comm: Comm, transformer: Any) -> None:
    """Refuse a Ulysses degree that does not divide the transformer's attention heads."""
    heads = transformer.config.num_attention_heads
    if heads % comm.ulysses.size:
        raise ConfigError(
            f"--ulysses {comm.ulysses.size} does not divide {spec.name}'s {heads} attention heads",
            field="ulysses",
        )


class ComponentsAdapter:
    """What a diffusers pipeline driven component by component is as a lifecycle pipeline,
    Wan's and Qwen-Image's alike (Qwen-Image's VAE is Wan's): its pipe and components, the CFG
    branches this rank computes, the latents through the VAE, and residency by `WanResidency`."""

    components: tuple[str, ...] = ("text_encoder", "transformer", "vae")
    residency: WanResidency

    def __init__(self, spec: ModelSpec, comm: Comm, pipe: Any) -> None:
        self.spec = spec
        self.comm = comm
        self.pipe = pipe
        pipe.set_progress_bar_config(disable=True)
        self.transformers = [
            m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m
        ]

    @property
    def parameter_bytes(self) -> int:
        modules = (self.pipe.text_encoder, *self.transformers, self.pipe.vae)
        return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())

    def _branches(self) -> tuple[str, ...]:
        """The CFG branches this rank computes: both, or its own of the cfg group's two."""
        layout = self.comm.layout
        if layout.cfg_parallel == 1:
            return (COND, UNCOND)
        return (COND,) if layout.cfg_rank == 0 else (UNCOND,)

    def _vae_decoded(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's output for `latents`, unnormalized by its latents' mean and deviation."""
        vae = self.pipe.vae
        z_dim = vae.config.z_dim
        latents = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, z_dim, 1, 1, 1).to(latents)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z_dim, 1, 1, 1).to(latents)
        return vae.decode(latents / inverse_std + mean, return_dict=False)[0]  # type: ignore[no-any-return]

    def apply_residency(self, choices: Sequence[ResidencyOption]) -> None:
        self.residency.apply(choices)


class WanAdapter(ComponentsAdapter):
    """A `WanPipeline` (its components, loaded by diffusers) as a lifecycle pipeline."""

    def __init__(self, spec: ModelSpec, comm: Comm, pipe: Any) -> None:
        super().__init__(spec, comm, pipe)
        transformers = self.transformers
        # Wan 2.2: the high-noise expert until the boundary, the low-noise one after it.
        self._experts = transformers if pipe.config.boundary_ratio is not None else transformers[:1]
        self.residency = WanResidency(
            pipe,
            comm.device,
            tile_size(spec.default_shape),
            self._experts if len(self._experts) == 2 else (),
        )
        for transformer in self._experts:
            require_heads_split(spec, comm, transformer)
        if comm.ulysses.size > 1 and pipe.config.expand_timesteps:
            raise ConfigError(
                f"{spec.name} embeds a timestep per token (expand_timesteps): Ulysses is not"
                " supported for it; use --ulysses 1",
                field="ulysses",
            )

    def repeated_blocks(self) -> tuple[Any, ...]:
        return repeated_blocks_of(*self._experts)

    # -- text encoder ------------------------------------------------------------------------

    @torch.no_grad()
    def _encode(self, text: str) -> torch.Tensor:
        with self.residency.text_encoder_in_use():
            embeds, _ = self.pipe.encode_prompt(
                prompt=text,
                do_classifier_free_guidance=False,
                max_sequence_length=MAX_SEQUENCE_LENGTH,
                device=self.comm.device,
            )
        return embeds.to(self.transformers[0].dtype)  # type: ignore[no-any-return]

    def encode_prompt(self, prompt: str, negative_prompt: str) -> WanEmbeds:
        embeds = WanEmbeds(texts={COND: prompt, UNCOND: negative_prompt})
        for branch in self._branches():
            embeds.embeds[branch] = self._encode(embeds.texts[branch])
        return embeds

    # -- transformer -------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(
        self,
        embeds: WanEmbeds,
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
        guidance_scale_2: float | None = None,
    ) -> torch.Tensor:
        """WanPipeline's denoising loop, each branch where the layout puts it; Wan 2.2's
        low-noise expert guided by `guidance_scale_2` (None: `guidance_scale`, as
        WanPipeline)."""
        pipe, comm = self.pipe, self.comm
        device = comm.device
        # WanPipeline guides every step, both experts', when its first scale asks for it.
        guided = guidance_scale > 1.0
        if not guided and COND not in embeds.embeds:
            embeds.embeds[COND] = self._encode(embeds.texts[COND])
        first = self.transformers[0]
        pipe.scheduler.set_timesteps(steps, device=device)
        timesteps = pipe.scheduler.timesteps
        latents = pipe.prepare_latents(
            1,
            first.config.in_channels,
            shape.height,
            shape.width,
            shape.frames,
            torch.float32,
            device,
            torch.Generator("cpu").manual_seed(seed),
            None,
        )
        mask = torch.ones(latents.shape, dtype=torch.float32, device=device)
        pipe.scheduler.set_begin_index(0)
        experts = self._expert_of_steps(timesteps)
        scales = (guidance_scale, guidance_scale if guidance_scale_2 is None else guidance_scale_2)
        # This rank's last pass of a step: where a handover to the next expert rides along.
        last_branch = COND if not guided else (UNCOND if UNCOND in embeds.embeds else COND)
        swap = self.residency.experts
        swap.begin_request()
        with contextlib.ExitStack() as parallel:
            for transformer in self._experts:
                parallel.enter_context(ulysses_transformer(transformer, comm))
            for step, t in enumerate(timesteps):
                expert = experts[step]
                # After the last step, back to the expert the next request starts with.
                following = experts[step + 1] if step + 1 < len(experts) else experts[0]
                swap.ready(expert)
                model = self._experts[expert]
                x = latents.to(model.dtype)
                if pipe.config.expand_timesteps:
                    timestep = (mask[0][0][:, ::2, ::2] * t).flatten().unsqueeze(0)
                else:
                    timestep = t.expand(latents.shape[0])

                def predict(
                    branch: str,
                    model: Any = model,
                    x: Any = x,
                    timestep: Any = timestep,
                    handover: Any = (expert, following, step),
                ) -> torch.Tensor:
                    carried = (
                        swap.handing_over(*handover)
                        if branch == last_branch
                        else contextlib.nullcontext()
                    )
                    with carried:
                        out: torch.Tensor = model(
                            hidden_states=x,
                            timestep=timestep,
                            encoder_hidden_states=embeds.embeds[branch],
                            return_dict=False,
                        )[0]
                    return out

                noise = self._guided(predict, embeds, guided=guided, scale=scales[expert])
                latents = pipe.scheduler.step(noise, t, latents, return_dict=False)[0]
                on_step(step)
            swap.settle()
        return latents  # type: ignore[no-any-return]

    def _expert_of_steps(self, timesteps: torch.Tensor) -> list[int]:
        """Each step's expert, as WanPipeline picks it: the high-noise one (0) while the
        timestep is at least boundary_ratio x num_train_timesteps, the low-noise one (1)
        after; 0 throughout without a boundary."""
        ratio = self.pipe.config.boundary_ratio
        if ratio is None or len(self._experts) < 2:
            return [0] * len(timesteps)
        boundary = ratio * self.pipe.scheduler.config.num_train_timesteps
        return [0 if t >= boundary else 1 for t in timesteps]

    def _guided(
        self,
        predict: Callable[[str], torch.Tensor],
        embeds: WanEmbeds,
        *,
        guided: bool,
        scale: float,
    ) -> torch.Tensor:
        """The guided noise prediction: both branches here, or one here and one on the peer
        of the cfg group, gathered."""
        if not guided:
            return predict(COND)
        cond, uncond = cfg_branches(self.comm, predict, embeds.embeds)
        return uncond + scale * (cond - uncond)

    # -- vae ---------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        """WanPipeline's decoding to frames in [0, 1], as uint8 (frames, height, width, 3)."""
        video = self._vae_decoded(latents)
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")[0]
        return torch.from_numpy(to_uint8(frames))

    # -- residency ---------------------------------------------------------------------------

    def residency_options(self, shape: Shape) -> tuple[ResidencyOption, ...]:
        experts = self._experts if len(self._experts) == 2 else ()
        return wan_options(self.pipe, shape, self.residency.tiling, self.comm.device.type, experts)


def to_uint8(frames: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Frames in [0, 1] as uint8, as a video writer quantizes them."""
    return np.clip(np.round(frames * 255.0), 0, 255).astype(np.uint8)
