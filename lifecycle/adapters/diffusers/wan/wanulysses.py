"""Ulysses sequence parallelism for diffusers' Wan transformer, over the lifecycle's recorded
Ulysses group: every all-to-all and gather a rank waits in is journaled like the lifecycle's own.

The transformer is diffusers' own, driven through module hooks: the rotary table and the
first block's input are cut to this rank's share of the tokens (padded to a multiple of the
group, the padding masked out of attention), each block's self-attention trades that share
of every head for all the tokens of 1/K of the heads and back (`UlyssesAttention`), and the
output projection's result is gathered whole again. Cross-attention needs no exchange: each
token attends to the whole prompt on its own rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lifecycle.pipelines import Comm, UlyssesAttention


@dataclass(slots=True)
class _Split:
    """How the current forward's tokens are shared out: set by the rotary hook each call."""

    tokens: int = 0
    local: int = 0
    key_mask: torch.Tensor | None = None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs, as its own attention processor applies it."""
    x1, x2 = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesWanSelfAttention:
    """A processor for a Wan block's self-attention (`attn1`) over this rank's tokens."""

    def __init__(self, attention: UlyssesAttention, split: _Split) -> None:
        self._attention = attention
        self._split = split

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = (
                attn.to_q(hidden_states),
                attn.to_k(hidden_states),
                attn.to_v(hidden_states),
            )
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        qkv = torch.stack((query, key, value), dim=2)  # (B, tokens here, 3, heads, head dim)
        out = self._attention(qkv, self._split.key_mask).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))  # type: ignore[no-any-return]


def share_tokens(x: torch.Tensor, comm: Comm, *, tokens: int, local: int, dim: int) -> torch.Tensor:
    """This rank's contiguous share (`local` of them) of `x`'s `tokens` along `dim`, the last
    share zero-padded at the end."""
    pad = local * comm.ulysses.size - tokens
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat((x, x.new_zeros(shape)), dim=dim)
    return x.narrow(dim, comm.layout.ulysses_rank * local, local).contiguous()


def gather_tokens(out: torch.Tensor, comm: Comm, *, tokens: int) -> torch.Tensor:
    """Every rank's share of the output's tokens (dim 1), gathered in rank order through the
    recorded Ulysses group, the padding cut."""
    group = comm.ulysses
    gathered = comm.staging.get(
        purpose="ulysses-gather", shape=(group.size, *out.shape), dtype=out.dtype, group=group
    )
    group.all_gather(gathered, out.contiguous(), purpose="ulysses-gather")
    return torch.cat(gathered.unbind(0), dim=1)[:, :tokens]


def _share(x: torch.Tensor, split: _Split, comm: Comm) -> torch.Tensor:
    return share_tokens(x, comm, tokens=split.tokens, local=split.local, dim=1)


def ulysses_transformer(transformer: Any, comm: Comm) -> AbstractContextManager[None]:
    """Run `transformer` (a WanTransformer3DModel) sequence-parallel over `comm.ulysses` while
    inside; its own processors and no hook of ours remain after."""
    group = comm.ulysses
    split = _Split()
    blocks = list(transformer.blocks)

    def on_rope(
        _module: Any, _args: Any, out: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        split.tokens = out[0].shape[1]
        split.local = -(-split.tokens // group.size)
        padded = split.local * group.size
        split.key_mask = (
            None
            if padded == split.tokens
            else torch.arange(padded, device=comm.device) < split.tokens
        )
        return tuple(_share(o, split, comm) for o in out)

    def before_first_block(_module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (_share(args[0], split, comm), *args[1:])

    def on_projection(_module: Any, _args: Any, out: torch.Tensor) -> torch.Tensor:
        return gather_tokens(out, comm, tokens=split.tokens)

    return sequence_parallel(
        comm,
        [block.attn1 for block in blocks],
        processor=lambda attention: UlyssesWanSelfAttention(attention, split),
        hooks=lambda: [
            transformer.rope.register_forward_hook(on_rope),
            blocks[0].register_forward_pre_hook(before_first_block),
            transformer.proj_out.register_forward_hook(on_projection),
        ],
    )


@contextmanager
def sequence_parallel(
    comm: Comm,
    attentions: Sequence[Any],
    *,
    processor: Callable[[UlyssesAttention], Any],
    hooks: Callable[[], list[Any]],
) -> Iterator[None]:
    """While inside, a transformer's `attentions` run `processor(...)` (each over one
    `UlyssesAttention` of `comm`) and the module hooks that `hooks()` registers are in place;
    after, the attentions have their own processors back and no hook is left. With one rank
    in the Ulysses group, nothing changes."""
    if comm.ulysses.size == 1:
        yield
        return
    attention = UlyssesAttention(comm)
    originals = [attn.processor for attn in attentions]
    registered: list[Any] = []
    try:
        for attn in attentions:
            attn.set_processor(processor(attention))
        registered = hooks()
        yield
    finally:
        for hook in registered:
            hook.remove()
        for attn, original in zip(attentions, originals, strict=True):
            attn.set_processor(original)
