"""The Qwen-Image adapter: diffusers' own Qwen-Image components (the Qwen2.5-VL text encoder
with the pipeline's prompt template, QwenImageTransformer2DModel, AutoencoderKLQwenImage and
the directory's scheduler) driven through the lifecycle's pipeline protocol.

With the same seed its image is `QwenImagePipeline`'s: the same prompt encoding (template,
dropped prefix, mask), the same packed latents from the same generator, the same shifted
sigmas, the same transformer calls (one per branch, batch 1) and true classifier-free
guidance with its norm rescale, the same scheduler steps and decoding. CFG-parallel gives each
branch to one rank of the cfg group and gathers the two predictions through a recorded
all-gather; Ulysses shares the image tokens over the ulysses group (`qwenulysses.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lifecycle.adapters.diffusers.qwen.qwenulysses import ulysses_qwen_transformer
from lifecycle.adapters.diffusers.regions import repeated_blocks_of
from lifecycle.adapters.diffusers.wan.wanadapter import (
    COND,
    UNCOND,
    ComponentsAdapter,
    cfg_branches,
    require_heads_split,
    to_uint8,
)
from lifecycle.adapters.diffusers.wan.wanplacement import WanResidency, tile_size, wan_options
from lifecycle.pipelines import Comm, ModelSpec, ResidencyOption, Shape

# What QwenImagePipeline.__call__ encodes a prompt to, by default.
MAX_SEQUENCE_LENGTH = 512


@dataclass(slots=True)
class QwenEmbeds:
    """The branches this rank computes: each prompt's embeddings and mask (None: all of it)."""

    texts: dict[str, str]
    embeds: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)


class QwenImageAdapter(ComponentsAdapter):
    """A `QwenImagePipeline` (its components, loaded by diffusers) as a lifecycle pipeline."""

    def __init__(self, spec: ModelSpec, comm: Comm, pipe: Any) -> None:
        super().__init__(spec, comm, pipe)
        # Qwen-Image's VAE is Wan's, one frame at a time: the same tiling and offload knobs.
        self.residency = WanResidency(pipe, comm.device, tile_size(spec.default_shape))
        require_heads_split(spec, comm, pipe.transformer)

    def repeated_blocks(self) -> tuple[Any, ...]:
        return repeated_blocks_of(self.pipe.transformer)

    # -- text encoder ------------------------------------------------------------------------

    @torch.no_grad()
    def _encode(self, text: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self.residency.text_encoder_in_use():
            embeds, mask = self.pipe.encode_prompt(
                prompt=text, device=self.comm.device, max_sequence_length=MAX_SEQUENCE_LENGTH
            )
        return embeds, mask

    def encode_prompt(self, prompt: str, negative_prompt: str) -> QwenEmbeds:
        """Both prompts, where this rank computes them; no negative prompt, no guidance (as
        QwenImagePipeline given none)."""
        embeds = QwenEmbeds(texts={COND: prompt, UNCOND: negative_prompt})
        for branch in self._branches():
            if branch == COND or negative_prompt:
                embeds.embeds[branch] = self._encode(embeds.texts[branch])
        return embeds

    # -- transformer -------------------------------------------------------------------------

    @torch.no_grad()
    def denoise(
        self,
        embeds: QwenEmbeds,
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor:
        """QwenImagePipeline's loop, `guidance_scale` as its true_cfg_scale, each branch where
        the layout puts it."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import (
            calculate_shift,
            retrieve_timesteps,
        )

        pipe, comm = self.pipe, self.comm
        device = comm.device
        guided = guidance_scale > 1 and bool(embeds.texts[UNCOND])
        if not guided and COND not in embeds.embeds:
            embeds.embeds[COND] = self._encode(embeds.texts[COND])
        transformer = pipe.transformer
        dtype = next(iter(embeds.embeds.values()))[0].dtype
        latents = pipe.prepare_latents(
            1,
            transformer.config.in_channels // 4,
            shape.height,
            shape.width,
            dtype,
            device,
            torch.Generator("cpu").manual_seed(seed),
            None,
        )
        factor = pipe.vae_scale_factor
        img_shapes = [[(1, shape.height // factor // 2, shape.width // factor // 2)]]
        config = pipe.scheduler.config
        mu = calculate_shift(
            latents.shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)
        with ulysses_qwen_transformer(transformer, comm):
            for step, t in enumerate(timesteps):
                timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000

                def predict(branch: str, x: Any = latents, timestep: Any = timestep) -> Any:
                    prompt, mask = embeds.embeds[branch]
                    return transformer(
                        hidden_states=x,
                        timestep=timestep,
                        guidance=None,
                        encoder_hidden_states_mask=mask,
                        encoder_hidden_states=prompt,
                        img_shapes=img_shapes,
                        attention_kwargs={},
                        return_dict=False,
                    )[0]

                noise = self._guided(predict, embeds, guided=guided, scale=guidance_scale)
                latents = pipe.scheduler.step(noise, t, latents, return_dict=False)[0]
                on_step(step)
        return latents  # type: ignore[no-any-return]

    def _guided(
        self, predict: Callable[[str], torch.Tensor], embeds: QwenEmbeds, *, guided: bool,
        scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """True CFG as QwenImagePipeline: the guided prediction rescaled to the conditional
        one's norm; both branches here, or one here and one on the cfg peer, gathered."""
        if not guided:
            return predict(COND)
        cond, uncond = cfg_branches(self.comm, predict, embeds.embeds)
        guided_noise = uncond + scale * (cond - uncond)
        cond_norm = torch.norm(cond, dim=-1, keepdim=True)
        rescaled: torch.Tensor = guided_noise * (
            cond_norm / torch.norm(guided_noise, dim=-1, keepdim=True)
        )
        return rescaled

    # -- vae ---------------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        """QwenImagePipeline's decoding to an image in [0, 1], as uint8 (1, height, width, 3)."""
        pipe = self.pipe
        latents = pipe._unpack_latents(latents, shape.height, shape.width, pipe.vae_scale_factor)
        image = self._vae_decoded(latents)[:, :, 0]
        frames = pipe.image_processor.postprocess(image, output_type="np")
        return torch.from_numpy(to_uint8(np.asarray(frames)))

    # -- residency ---------------------------------------------------------------------------

    def residency_options(self, shape: Shape) -> tuple[ResidencyOption, ...]:
        return wan_options(self.pipe, shape, self.residency.tiling, self.comm.device.type)
