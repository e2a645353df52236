"""The built-in tiny text-to-video pipeline: text encoder, Ulysses DiT, chunked decoder."""

from __future__ import annotations

import hashlib
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lifecycle.core.format.records import ResidencyOption, Shape
from lifecycle.core.settings.modelspec import ModelSpec
from lifecycle.runtime.group.comm import Comm
from lifecycle.runtime.group.ulysses import UlyssesAttention
from lifecycle.runtime.phases import component_load
from lifecycle.runtime.pipeline.decoder import Decoder, decode_video
from lifecycle.runtime.pipeline.placement import (
    OFFLOADED,
    TEXT_ENCODER,
    DecoderGeometry,
    DecoderResidency,
    Offloader,
    options_for,
)
from lifecycle.runtime.pipeline.tinyconfig import TinyConfig


def _seeded(name: str) -> torch.Generator:
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big") >> 1
    return torch.Generator().manual_seed(seed)


def _sinusoid(positions: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TextEncoder(nn.Module):
    """A small transformer over the prompt's UTF-8 bytes."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(257, cfg.text_dim)  # 256 byte values + padding
        self.bigrams = nn.Embedding(cfg.text_buckets, cfg.text_dim)
        self.pos = nn.Parameter(torch.zeros(cfg.text_len, cfg.text_dim))
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                cfg.text_dim,
                nhead=4,
                dim_feedforward=cfg.text_dim * 2,
                batch_first=True,
                dropout=0.0,
            )
            for _ in range(cfg.text_layers)
        )
        self.norm = nn.LayerNorm(cfg.text_dim)

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        rows = []
        for prompt in prompts:
            ids = list(prompt.encode("utf-8")[: self.cfg.text_len])
            rows.append(ids + [256] * (self.cfg.text_len - len(ids)))
        return torch.tensor(rows, dtype=torch.long)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pairs = (tokens[:, :-1] * 257 + tokens[:, 1:]) % self.cfg.text_buckets
        x = self.embed(tokens) + self.pos
        x[:, 1:] += self.bigrams(pairs)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


class DiTBlock(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.cross_q = nn.Linear(d, d)
        self.cross_kv = nn.Linear(cfg.text_dim, 2 * d)
        self.cross_proj = nn.Linear(d, d)
        self.norm3 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(d, d * cfg.mlp_ratio),
            nn.GELU(approximate="tanh"),
            nn.Linear(d * cfg.mlp_ratio, d),
        )
        self.modulation = nn.Linear(d, 6 * d)

    def forward(
        self,
        x: torch.Tensor,
        t_emb: torch.Tensor,
        text: torch.Tensor,
        attention: UlyssesAttention,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(t_emb)[:, None].chunk(6, -1)
        y = self.norm1(x) * (1 + scale1) + shift1
        qkv = self.qkv(y).view(b, n, 3, h, d // h)
        x = x + gate1 * self.proj(attention(qkv, key_mask).reshape(b, n, d))
        q = self.cross_q(self.norm2(x)).view(b, n, h, d // h).transpose(1, 2)
        kv = self.cross_kv(text).view(b, -1, 2, h, d // h).permute(2, 0, 3, 1, 4)
        cross = F.scaled_dot_product_attention(q, kv[0], kv[1]).transpose(1, 2).reshape(b, n, d)
        x = x + self.cross_proj(cross)
        y = self.norm3(x) * (1 + scale2) + shift2
        out: torch.Tensor = x + gate2 * self.mlp(y)
        return out


class DiT(nn.Module):
    """A diffusion transformer over patchified video latents, sequence-parallel by Ulysses."""

    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        p, c, d = cfg.patch, cfg.latent_channels, cfg.dim
        self.patch_embed = nn.Linear(c * p * p, d)
        self.time_mlp = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.LayerNorm(d, elementwise_affine=False)
        self.final_mod = nn.Linear(d, 2 * d)
        self.final = nn.Linear(d, c * p * p)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        sigma: torch.Tensor,
        text: torch.Tensor,
        attention: UlyssesAttention,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.patch_embed(tokens) + positions
        t_emb = self.time_mlp(_sinusoid(sigma * 1000.0, self.cfg.dim))
        for block in self.blocks:
            x = block(x, t_emb, text, attention, key_mask)
        shift, scale = self.final_mod(t_emb)[:, None].chunk(2, -1)
        out: torch.Tensor = self.final(self.final_norm(x) * (1 + scale) + shift)
        return out


@dataclass(slots=True)
class PromptEmbeds:
    text: torch.Tensor  # (branches, L, text_dim)
    branches: tuple[str, ...]  # which CFG branches this rank computes: "cond", "uncond"


M = typing.TypeVar("M", bound=nn.Module)


def _built(name: str, module: M, generator: torch.Generator, device: torch.device) -> M:
    """A component's weights drawn and moved to the device, as its load."""
    with component_load(name) as load, torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        load.read_done(
            dtype=next(module.parameters()).dtype,
            nbytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        )
        module.to(device).eval()
    return module


class TinyVideoPipeline:
    """Text encoder, DiT and decoder of `tiny-video`, with deterministic random weights."""

    components: tuple[str, ...] = ("text_encoder", "dit", "vae")

    def __init__(self, spec: ModelSpec, *, comm: Comm, cfg: TinyConfig | None = None) -> None:
        self.spec = spec
        self.cfg = cfg or TinyConfig(heads=spec.attention_heads)
        self.comm = comm
        device = comm.device
        generator = _seeded(spec.name)
        # One after another: the weights are drawn from one generator, in this order.
        self.text_encoder = _built("text_encoder", TextEncoder(self.cfg), generator, device)
        self.dit = _built("dit", DiT(self.cfg), generator, device)
        self.vae = _built("vae", Decoder(self.cfg), generator, device)
        self.attention = UlyssesAttention(comm)
        self.decoder_residency = DecoderResidency()
        self.offload_text_encoder = False
        self.text_offloader = Offloader(self.text_encoder, device)

    @property
    def parameter_bytes(self) -> int:
        return sum(
            p.numel() * p.element_size()
            for m in (self.text_encoder, self.dit, self.vae)
            for p in m.parameters()
        )

    def repeated_blocks(self) -> tuple[nn.Module, ...]:
        return tuple(self.dit.blocks)

    def branches(self) -> tuple[str, ...]:
        if self.comm.layout.cfg_parallel == 1:
            return ("cond", "uncond")
        return ("cond",) if self.comm.layout.cfg_rank == 0 else ("uncond",)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str, negative_prompt: str) -> PromptEmbeds:
        branches = self.branches()
        prompts = [prompt if b == "cond" else negative_prompt for b in branches]
        tokens = self.text_encoder.tokenize(prompts).to(self.comm.device)
        self.text_offloader.restore()
        text = self.text_encoder(tokens)
        if self.offload_text_encoder:
            self.text_offloader.offload()
        return PromptEmbeds(text=text, branches=branches)

    def latent_shape(self, shape: Shape) -> tuple[int, int, int, int]:
        cfg = self.cfg
        grid = cfg.vae_spatial * cfg.patch
        frames = (shape.frames - 1) // cfg.vae_temporal + 1
        height = -(-shape.height // grid) * cfg.patch
        width = -(-shape.width // grid) * cfg.patch
        return (cfg.latent_channels, frames, height, width)

    @torch.inference_mode()
    def denoise(
        self,
        embeds: PromptEmbeds,
        shape: Shape,
        steps: int,
        *,
        seed: int,
        guidance_scale: float,
        on_step: Callable[[int], None],
    ) -> torch.Tensor:
        """Flow-matching Euler steps with classifier-free guidance; returns the final latents."""
        cfg, comm = self.cfg, self.comm
        device = comm.device
        c, t, h, w = self.latent_shape(shape)
        p = cfg.patch
        generator = torch.Generator().manual_seed(seed)
        latents = torch.randn((1, c, t, h, w), generator=generator).to(device)
        n = t * (h // p) * (w // p)
        k = comm.ulysses.size
        n_local = -(-n // k)
        n_padded = n_local * k
        key_mask = None
        if n_padded != n:
            key_mask = torch.arange(n_padded, device=device) < n
        grid = torch.stack(
            torch.meshgrid(
                torch.arange(t), torch.arange(h // p), torch.arange(w // p), indexing="ij"
            ),
            dim=-1,
        ).reshape(-1, 3)
        positions = sum(_sinusoid(grid[:, i].to(device) * (i + 1), cfg.dim) for i in range(3))
        assert isinstance(positions, torch.Tensor)
        positions = F.pad(positions, (0, 0, 0, n_padded - n))
        lo = comm.layout.ulysses_rank * n_local
        positions_local = positions[lo : lo + n_local]
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
        branches = len(embeds.branches)
        token_dim = c * p * p
        for step in range(steps):
            tokens = self._patchify(latents).expand(branches, -1, -1)
            tokens = F.pad(tokens, (0, 0, 0, n_padded - n))[:, lo : lo + n_local]
            sigma = sigmas[step].expand(branches).to(device)
            local = self.dit(tokens, positions_local, sigma, embeds.text, self.attention, key_mask)
            velocity = self._gather_sequence(local.contiguous(), n, token_dim)
            cond, uncond = self._gather_branches(velocity, embeds.branches)
            guided = uncond + guidance_scale * (cond - uncond)
            latents = latents + (sigmas[step + 1] - sigmas[step]) * self._unpatchify(
                guided[None], (c, t, h, w)
            )
            on_step(step)
        return latents

    def _gather_sequence(self, local: torch.Tensor, n: int, token_dim: int) -> torch.Tensor:
        group = self.comm.ulysses
        branches, n_local, _ = local.shape
        buffer = self.comm.staging.get(
            purpose="ulysses-gather",
            shape=(group.size, branches, n_local, token_dim),
            dtype=local.dtype,
            group=group,
        )
        group.all_gather(buffer, local, purpose="ulysses-gather")
        return buffer.permute(1, 0, 2, 3).reshape(branches, -1, token_dim)[:, :n]

    def _gather_branches(
        self, velocity: torch.Tensor, branches: tuple[str, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(branches) == 2:
            return velocity[0], velocity[1]
        group = self.comm.cfg
        buffer = self.comm.staging.get(
            purpose="cfg-gather",
            shape=(group.size, *velocity.shape[1:]),
            dtype=velocity.dtype,
            group=group,
        )
        group.all_gather(buffer, velocity[0], purpose="cfg-gather")
        return buffer[0], buffer[1]

    def _patchify(self, latents: torch.Tensor) -> torch.Tensor:
        _, c, t, h, w = latents.shape
        p = self.cfg.patch
        x = latents.view(1, c, t, h // p, p, w // p, p).permute(0, 2, 3, 5, 1, 4, 6)
        return x.reshape(1, t * (h // p) * (w // p), c * p * p)

    def _unpatchify(self, tokens: torch.Tensor, latent: tuple[int, int, int, int]) -> torch.Tensor:
        c, t, h, w = latent
        p = self.cfg.patch
        x = tokens.view(1, t, h // p, w // p, c, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return x.reshape(1, c, t, h, w)

    # -- residency ---------------------------------------------------------------------------

    def residency_options(self, shape: Shape) -> tuple[ResidencyOption, ...]:
        """The options the planner may choose from, with their expected effect at `shape`."""
        cfg = self.cfg
        _, frames, height, width = self.latent_shape(shape)
        s = cfg.vae_spatial
        geometry = DecoderGeometry(
            latent_frames=frames,
            frame_output_bytes=3 * cfg.vae_temporal * height * width * s * s * 4,
            video_bytes=shape.pixels * 3,
        )
        encoder_bytes = sum(p.numel() * p.element_size() for p in self.text_encoder.parameters())
        return options_for(geometry, encoder_bytes, self.comm.device.type)

    def apply_residency(self, choices: Sequence[ResidencyOption]) -> None:
        """Run with these options from the next request on."""
        self.decoder_residency = DecoderResidency.of(choices)
        self.offload_text_encoder = any(
            o.component == TEXT_ENCODER and o.name == OFFLOADED for o in choices
        )
        if self.offload_text_encoder:
            self.text_offloader.offload()
        else:
            self.text_offloader.restore()

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, shape: Shape) -> torch.Tensor:
        """Decode latents into a uint8 video (frames, height, width, 3)."""
        return decode_video(self.vae, latents, shape, self.decoder_residency)
