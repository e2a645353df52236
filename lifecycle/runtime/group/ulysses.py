"""Ulysses sequence parallelism's attention over the recorded Ulysses group: two all-to-alls
through persistent staging buffers around the attention itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from lifecycle.runtime.group.comm import Comm


class UlyssesAttention:
    """Self-attention over a sequence sharded across the Ulysses group.

    Each rank holds a contiguous shard of the tokens for every head; an all-to-all trades it
    for the whole sequence of 1/K of the heads, attention runs, and a second all-to-all trades
    back. Both exchanges go through persistent staging buffers.
    """

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self._group = comm.ulysses

    def __call__(self, qkv: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        # qkv: (B, n_local, 3, H, d) -> (B, n_local, H, d)
        k = self._group.size
        b, n_local, _, heads, d = qkv.shape
        hk = heads // k
        staging = self._comm.staging
        send_shape = (k, b, n_local, 3, hk, d)
        qkv_buf = staging.get(
            purpose="ulysses-qkv", shape=(2, *send_shape), dtype=qkv.dtype, group=self._group
        )
        qkv_buf[0].copy_(qkv.view(b, n_local, 3, k, hk, d).permute(3, 0, 1, 2, 4, 5))
        self._group.all_to_all(qkv_buf[1], qkv_buf[0], purpose="ulysses-qkv")
        # (K_src, B, n_local, 3, hk, d) -> (3, B, hk, N, d)
        full = qkv_buf[1].permute(3, 1, 4, 0, 2, 5).reshape(3, b, hk, k * n_local, d)
        mask = None if key_mask is None else key_mask.view(1, 1, 1, -1)
        out = F.scaled_dot_product_attention(full[0], full[1], full[2], attn_mask=mask)
        # (B, hk, N, d) -> (K_dst, B, n_local, hk, d)
        out_shape = (k, b, n_local, hk, d)
        out_buf = staging.get(
            purpose="ulysses-out", shape=(2, *out_shape), dtype=out.dtype, group=self._group
        )
        out_buf[0].copy_(out.view(b, hk, k, n_local, d).permute(2, 0, 3, 1, 4))
        self._group.all_to_all(out_buf[1], out_buf[0], purpose="ulysses-out")
        # (K_src = head chunk, B, n_local, hk, d) -> (B, n_local, H, d)
        return out_buf[1].permute(1, 2, 0, 3, 4).reshape(b, n_local, heads, d)
