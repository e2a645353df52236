"""`tiny-qwen-image`: diffusers' Qwen-Image text-to-image pipeline at a small size with seeded
random weights, built offline at start (no hub, no files shipped), so that the real diffusers
code path runs anywhere. Every rank builds the same weights from the same seed.

The tokenizer is a Qwen2 byte-level BPE over a fixed vocabulary: every byte as a token, the
chat template's special tokens, and merges that make each word of the template one token, so
that the template's prefix is exactly `prompt_template_encode_start_idx` tokens, as with
Qwen-Image's own tokenizer, and any prompt tokenizes, the same way on every rank.
"""

from __future__ import annotations

from typing import Any

from lifecycle.adapters.diffusers.library import diffusers_offline
from lifecycle.adapters.diffusers.qwen.qwenspec import qwen_image_spec
from lifecycle.adapters.diffusers.wan.tinywan import drawn_from_seed, seeded_component
from lifecycle.pipelines import ModelSpec, component_load

TINY_QWEN_IMAGE = "tiny-qwen-image"
SEED = 20260602
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The words of QwenImagePipeline's prompt template (a leading space is part of a word), and a
# few common ones of prompts.
_WORDS = (
    "system", "Describe", " the", " image", " by", " detailing", " color", " shape", " size",
    " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
    " background", "user", "assistant", " a", " cat", " dog", " walks", " in", " rain",
    " city", " night", " light",
)  # fmt: skip


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's printable symbol for each byte (GPT-2's table, which Qwen2 uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    symbols = dict(zip(printable, map(chr, printable), strict=True))
    shifted = (b for b in range(256) if b not in symbols)
    symbols.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return dict(sorted(symbols.items()))


def tiny_qwen_tokenizer() -> Any:
    """A Qwen2Tokenizer over the specials, every byte, and the words merged whole."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    symbols = _byte_symbols()
    vocab = {token: n for n, token in enumerate(SPECIALS)}
    for symbol in symbols.values():
        vocab.setdefault(symbol, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        spelled = "".join(symbols[b] for b in word.encode())
        merged = spelled[0]
        for symbol in spelled[1:]:
            if (merged, symbol) not in merges:
                merges.append((merged, symbol))
            merged += symbol
            vocab.setdefault(merged, len(vocab))
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tokenizer.add_tokens([AddedToken(s, special=True) for s in SPECIALS[1:]])
    return tokenizer


def tiny_qwen_image_spec() -> ModelSpec:
    """tiny-qwen-image's spec: QwenImagePipeline's grid and heads at a default request small
    enough for two CPU cores."""
    pipe = build_tiny_qwen_image()
    return qwen_image_spec(
        name=TINY_QWEN_IMAGE,
        source=None,
        digest="",
        transformer=dict(pipe.transformer.config),
        vae_scale_factor=pipe.vae_scale_factor,
        defaults={"width": 128, "height": 128, "num_inference_steps": 20, "true_cfg_scale": 4.0},
        # Its memory per pixel as its saved directory's spec reads it: from its own VAE.
        vae_base_dim=pipe.vae.config.base_dim,
    )


def build_tiny_qwen_image() -> Any:
    """A QwenImagePipeline of a few megabytes of weights, the same on every call."""
    diffusers_offline()
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with component_load("tokenizer"):
        tokenizer = tiny_qwen_tokenizer()
    words = len(tokenizer)
    end, im_end = tokenizer.convert_tokens_to_ids([SPECIALS[0], SPECIALS[2]])
    with drawn_from_seed(SEED):  # one after another: the weights are drawn in this order
        text_encoder = seeded_component(
            "text_encoder",
            lambda: Qwen2_5_VLForConditionalGeneration(
                Qwen2_5_VLConfig(
                    text_config={
                        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 2, "num_key_value_heads": 2,
                        "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default",
                                         "type": "default"},
                        "rope_theta": 1000000.0, "vocab_size": words + 3,
                        "bos_token_id": end, "eos_token_id": im_end,
                    },
                    vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16,
                                   "num_heads": 2, "out_hidden_size": 32},
                    hidden_size=32, vocab_size=words + 3, bos_token_id=end,
                    eos_token_id=im_end, vision_start_token_id=words,
                    vision_end_token_id=words + 1, vision_token_id=words + 2,
                    image_token_id=words + 2, video_token_id=words + 2,
                )
            ),
        )  # fmt: skip
        transformer = seeded_component(
            "transformer",
            lambda: QwenImageTransformer2DModel(
                patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                attention_head_dim=16, num_attention_heads=4, joint_attention_dim=32,
                guidance_embeds=False, axes_dims_rope=(8, 4, 4),
            ),
        )  # fmt: skip
        vae = seeded_component(
            "vae",
            lambda: AutoencoderKLQwenImage(
                base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                latents_std=[1.0] * 4,
            ),
        )  # fmt: skip
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
        tokenizer=tokenizer, transformer=transformer,
    )  # fmt: skip
