"""Ulysses sequence parallelism for diffusers' Qwen-Image transformer, over the lifecycle's
recorded Ulysses group: every all-to-all and gather a rank waits in is journaled like the
lifecycle's own.

Qwen-Image's blocks attend jointly over the prompt's tokens and the image's. The image tokens
are shared out (the rotary table's image rows and the first block's input cut to this rank's
share, padded to a multiple of the group), and the prompt's stream, short, runs whole on every
rank. Each joint attention sends `[prompt, image share]` through `UlyssesAttention`; in the
sequence it gathers, the prompt's tokens appear once per rank, and a key mask keeps only the
first copy (and no padding), so that each query attends to every token exactly once. The
output projection's result is gathered whole again.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from lifecycle.adapters.diffusers.wan.wanulysses import (
    gather_tokens,
    sequence_parallel,
    share_tokens,
)
from lifecycle.pipelines import Comm, UlyssesAttention


@dataclass(slots=True)
class _Split:
    """How the current forward's image tokens are shared out: set by the rotary hook."""

    tokens: int = 0
    local: int = 0


def _share(x: torch.Tensor, split: _Split, comm: Comm, dim: int) -> torch.Tensor:
    return share_tokens(x, comm, tokens=split.tokens, local=split.local, dim=dim)


class UlyssesQwenJointAttention:
    """A processor for a Qwen-Image block's joint attention over this rank's image tokens."""

    def __init__(self, attention: UlyssesAttention, split: _Split, comm: Comm) -> None:
        self._attention = attention
        self._split = split
        self._comm = comm

    def _key_mask(self, text: torch.Tensor | None, prompt: int) -> torch.Tensor:
        """Over the gathered `[prompt, image share]` of every rank: the first rank's prompt
        (where its own mask allows) and every real image token."""
        group, split = self._comm.ulysses.size, self._split
        device = self._comm.device
        chunks = []
        for rank in range(group):
            if rank > 0:
                keep = torch.zeros(prompt, dtype=torch.bool, device=device)
            elif text is None:
                keep = torch.ones(prompt, dtype=torch.bool, device=device)
            else:
                keep = text.to(device=device, dtype=torch.bool)
            image = torch.arange(split.local, device=device) + rank * split.local < split.tokens
            chunks += [keep, image]
        return torch.cat(chunks)

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        assert encoder_hidden_states is not None and attention_mask is None
        if hidden_states.shape[0] != 1:
            raise ValueError("Ulysses attention runs one request at a time (batch 1)")
        head_dim = attn.inner_dim // attn.heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(*t.shape[:-1], -1, head_dim)

        img_q, img_k, img_v = (heads(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        txt = encoder_hidden_states
        txt_q, txt_k, txt_v = (
            heads(p(txt)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        if attn.norm_q is not None:
            img_q = attn.norm_q(img_q)
        if attn.norm_k is not None:
            img_k = attn.norm_k(img_k)
        if attn.norm_added_q is not None:
            txt_q = attn.norm_added_q(txt_q)
        if attn.norm_added_k is not None:
            txt_k = attn.norm_added_k(txt_k)
        if image_rotary_emb is not None:
            img_freqs, txt_freqs = image_rotary_emb
            img_q = apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
            img_k = apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
            txt_q = apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
            txt_k = apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)
        prompt = txt.shape[1]
        qkv = torch.stack(
            (
                torch.cat((txt_q, img_q), dim=1),
                torch.cat((txt_k, img_k), dim=1),
                torch.cat((txt_v, img_v), dim=1),
            ),
            dim=2,
        )  # (1, prompt + image share, 3, heads, head dim)
        text_mask = None if encoder_hidden_states_mask is None else encoder_hidden_states_mask[0]
        joint = self._attention(qkv, self._key_mask(text_mask, prompt))
        joint = joint.flatten(2, 3).to(qkv.dtype)
        txt_out, img_out = joint[:, :prompt], joint[:, prompt:]
        img_out = attn.to_out[0](img_out.contiguous())
        if len(attn.to_out) > 1:
            img_out = attn.to_out[1](img_out)
        return img_out, attn.to_add_out(txt_out.contiguous())


def ulysses_qwen_transformer(transformer: Any, comm: Comm) -> AbstractContextManager[None]:
    """Run `transformer` (a QwenImageTransformer2DModel) sequence-parallel over
    `comm.ulysses` while inside; its own processors and no hook of ours remain after."""
    group = comm.ulysses
    split = _Split()
    blocks = list(transformer.transformer_blocks)

    def on_rope(_module: Any, _args: Any, out: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        img_freqs, *rest = out
        split.tokens = img_freqs.shape[0]
        split.local = -(-split.tokens // group.size)
        return (_share(img_freqs, split, comm, dim=0), *rest)

    def before_first_block(
        _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, "hidden_states": _share(kwargs["hidden_states"], split, comm, 1)}

    def on_projection(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return gather_tokens(out, comm, tokens=split.tokens)

    return sequence_parallel(
        comm,
        [block.attn for block in blocks],
        processor=lambda attention: UlyssesQwenJointAttention(attention, split, comm),
        hooks=lambda: [
            transformer.pos_embed.register_forward_hook(on_rope),
            blocks[0].register_forward_pre_hook(before_first_block, with_kwargs=True),
            transformer.proj_out.register_forward_hook(on_projection),
        ],
    )
