"""Small Wan pipeline directories written by diffusers' own `save_pretrained`, from configs
built here (as diffusers' tests build theirs), with a scheduler other than tiny-wan's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lifecycle.adapters.diffusers.tinywan import tiny_vocabulary


def small_wan(*, heads: int = 2, layers: int = 1, scheduler: str = "unipc") -> Any:
    """A WanPipeline unlike tiny-wan: another size, another head count, another scheduler."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    torch.manual_seed(7)
    tokenizer = T5Tokenizer(vocab=tiny_vocabulary(), extra_ids=0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=48, num_layers=1,
                   num_heads=4, relative_attention_num_buckets=8)
    ).eval()  # fmt: skip
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
