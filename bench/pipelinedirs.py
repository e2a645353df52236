"""Small pipeline directories written by diffusers' own `save_pretrained`, from configs built
here (as diffusers' tests build theirs): Wan with a scheduler other than tiny-wan's, Wan 2.2
with its two experts, and classes run through their own call (DDPM, LTX-Video); and weights
rewritten in place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lifecycle.adapters.diffusers.wan.tinywan import tiny_vocabulary


def small_text_encoder(config_class: Any, encoder_class: Any) -> tuple[Any, Any]:
    """A T5 tokenizer of the tiny vocabulary and a one-layer text encoder for it
    (`encoder_class` of a `config_class` config), its weights drawn from torch's generator."""
    from transformers import T5Tokenizer

    tokenizer = T5Tokenizer(vocab=tiny_vocabulary(), extra_ids=0)
    text_encoder = encoder_class(
        config_class(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=48, num_layers=1,
                     num_heads=4, relative_attention_num_buckets=8)
    ).eval()  # fmt: skip
    return tokenizer, text_encoder


def small_wan(*, heads: int = 2, layers: int = 1, scheduler: str = "unipc") -> Any:
    """A WanPipeline unlike tiny-wan: another size, another head count, another scheduler."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(7)
    tokenizer, text_encoder = small_text_encoder(UMT5Config, UMT5EncoderModel)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=layers,
    ).eval()  # fmt: skip
    vae = AutoencoderKLWan(
        base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()  # fmt: skip
    schedulers = {
        "unipc": lambda: UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=2.0
        ),
        "euler": lambda: FlowMatchEulerDiscreteScheduler(shift=5.0),
    }
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
        scheduler=schedulers[scheduler](), transformer=transformer,
    )  # fmt: skip


def save_small_wan(path: Path, **kw: Any) -> Path:
    small_wan(**kw).save_pretrained(str(path))
    return path


def small_wan22(
    *, boundary_ratio: float = 0.75, heads: int = 2, layers: int = 2, heads_2: int | None = None,
    head_dim_2: int = 8, ffn_dim: int = 32,
) -> Any:  # fmt: skip
    """A Wan 2.2 WanPipeline: a high-noise expert (`transformer`) and a low-noise one
    (`transformer_2`, its own weights; another width when `heads_2` or `head_dim_2` say so)
    switching at `boundary_ratio`."""
    from diffusers import WanPipeline, WanTransformer3DModel

    base = small_wan(heads=heads, layers=layers, scheduler="unipc")

    def expert(heads: int, head_dim: int) -> Any:
        return WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=head_dim,
            in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=ffn_dim,
            num_layers=layers,
        ).eval()  # fmt: skip

    torch.manual_seed(8)
    transformer = expert(heads, 8)
    transformer_2 = expert(heads if heads_2 is None else heads_2, head_dim_2)
    return WanPipeline(
        tokenizer=base.tokenizer, text_encoder=base.text_encoder, vae=base.vae,
        scheduler=base.scheduler, transformer=transformer, transformer_2=transformer_2,
        boundary_ratio=boundary_ratio,
    )  # fmt: skip


def save_small_wan22(path: Path, **kw: Any) -> Path:
    small_wan22(**kw).save_pretrained(str(path))
    return path


def save_small_ddpm(path: Path) -> Path:
    """A pipeline class the lifecycle does not drive (unconditional DDPM), saved by diffusers."""
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(3)
    unet = UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4,
    ).eval()  # fmt: skip
    DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=100)).save_pretrained(
        str(path)
    )
    return path


def save_small_ltx(path: Path) -> Path:
    """LTX-Video, another pipeline class run through its own call, which decodes through
    `vae.decode` rather than the VAE module itself; configs as diffusers' own tests build."""
    from diffusers import (
        AutoencoderKLLTXVideo,
        FlowMatchEulerDiscreteScheduler,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(5)
    tokenizer, text_encoder = small_text_encoder(T5Config, T5EncoderModel)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
        attention_head_dim=8, cross_attention_dim=32, num_layers=1, caption_channels=32,
    ).eval()  # fmt: skip
    vae = AutoencoderKLLTXVideo(
        in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False), upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True,
        decoder_causal=False,
    ).eval()  # fmt: skip
    LTXPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, transformer=transformer,
    ).save_pretrained(str(path))  # fmt: skip
    return path


def rewrite_weights(weights: Path, *, seed: int | None = None, dtype: Any = None) -> None:
    """Rewrite a safetensors file at the same size: the same tensors with new values (`seed`),
    or the same bytes read as another dtype of the same width (`dtype`)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(weights), framework="pt") as found:
        metadata = found.metadata()
        tensors = {name: found.get_tensor(name) for name in found.keys()}  # noqa: SIM118
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        tensors = {
            name: torch.randn(t.shape, generator=generator).to(t.dtype)
            for name, t in tensors.items()
        }
    if dtype is not None:
        tensors = {name: t.view(dtype) for name, t in tensors.items()}
    before = weights.stat().st_size
    save_file(tensors, str(weights), metadata=metadata)
    assert weights.stat().st_size == before, "the rewrite was to keep the file's size"


def save_tiny_qwen_image(path: Path) -> Path:
    """tiny-qwen-image, saved by diffusers as a Qwen-Image directory."""
    from lifecycle.adapters.diffusers.qwen.tinyqwen import build_tiny_qwen_image

    build_tiny_qwen_image().save_pretrained(str(path))
    return path
