"""`tiny-wan`: diffusers' Wan text-to-video pipeline at a small size with seeded random weights,
built offline at start (no hub, no files shipped), so that the real diffusers code path runs
anywhere. Every rank builds the same weights from the same seed.

The tokenizer is a T5 (SentencePiece unigram) tokenizer over a fixed vocabulary: every byte
of printable ASCII as a piece, a word-start marker and a few common words, so that any prompt
tokenizes, and the same way on every rank and every start.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lifecycle.adapters.diffusers.library import diffusers_offline
from lifecycle.adapters.diffusers.specs import wan_spec
from lifecycle.pipelines import ModelSpec, component_load

TINY_WAN = "tiny-wan"
SEED = 20260601
_WORDS = (
    "a", "the", "of", "and", "in", "on", "at", "with", "to", "is", "cat", "dog", "city",
    "street", "night", "rain", "sea", "waves", "forest", "walks", "runs", "flies", "slow",
    "motion", "sunset", "light",
)  # fmt: skip


def tiny_vocabulary() -> list[tuple[str, float]]:
    """(piece, log probability) pairs: the specials T5 expects first, then words, then bytes."""
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    words = [(f"\u2581{word}", -4.0) for word in _WORDS]
    chars = [("\u2581", -6.0)] + [(ch, -8.0) for ch in string.printable[:94]]
    return specials + words + chars


@contextmanager
def drawn_from_seed(seed: int) -> Iterator[None]:
    """Inside, weights are drawn from one generator seeded with `seed` (the same weights on
    every call); after, the process's generator is as it was."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        yield
    finally:
        torch.random.set_rng_state(state)


def seeded_component(name: str, build: Callable[[], Any]) -> Any:
    """A component built with its seeded weights (in the dtype asked of it, see
    precision.built_in_dtypes), timed (and journaled inside a startup) as its load."""
    from lifecycle.adapters.diffusers.precision import in_asked_dtype

    with component_load(name) as load:
        module = in_asked_dtype(name, build().eval())
        load.read_done(
            dtype=module.dtype,
            nbytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        )
    return module


def tiny_wan_spec() -> ModelSpec:
    """tiny-wan's spec: WanPipeline's grid and heads at a default request small enough that a
    calibrated startup takes seconds on two CPU cores (and still larger than the bounded
    warmup, so that it can calibrate)."""
    pipe = build_tiny_wan()
    return wan_spec(
        name=TINY_WAN,
        source=None,
        digest="",
        pipe_configs={"vae": dict(pipe.vae.config), "transformer": dict(pipe.transformer.config)},
        defaults={"width": 128, "height": 128, "num_frames": 33, "num_inference_steps": 20},
    )


def build_tiny_wan() -> Any:
    """A WanPipeline of about a megabyte of weights, the same on every call."""
    diffusers_offline()
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import T5Tokenizer, UMT5Config, UMT5EncoderModel

    with component_load("tokenizer"):
        tokenizer = T5Tokenizer(vocab=tiny_vocabulary(), extra_ids=0)
    with drawn_from_seed(SEED):  # one after another: the weights are drawn in this order
        text_encoder = seeded_component(
            "text_encoder",
            lambda: UMT5EncoderModel(
                UMT5Config(
                    vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=2,
                    num_heads=4, relative_attention_num_buckets=8,
                )
            ),
        )  # fmt: skip
        transformer = seeded_component(
            "transformer",
            lambda: WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16,
                in_channels=16, out_channels=16, text_dim=64, freq_dim=64, ffn_dim=128,
                num_layers=2,
            ),
        )  # fmt: skip
        vae = seeded_component(
            "vae",
            lambda: AutoencoderKLWan(
                base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                temperal_downsample=[False, True, True],
            ),
        )  # fmt: skip
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=transformer,
    )
