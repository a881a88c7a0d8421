"""Attention over another block's keys and values (KV sharing: Gemma 3n, Gemma 4)."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.attention.mha import Attention
from etblocks.attention.rope import RotaryEmbedding
from etblocks.attention.sdpa import SDPA
from etblocks.state.shared import KVShare


class KVSharedAttention(Attention):
    """Attention whose keys and values are an earlier block's: its own `q_proj`, per-head `q_norm`, rope, SDPA and
    `o_proj`, no k/v projections and no state. The source block (an `Attention` whose `kv_share` is `reads`)
    publishes what it attended over in each call and this block reads it in the same forward pass, so a dynamic
    program keeps one cache per source and a static program binds one per source, whatever the number of layers
    reading it. Give it the source's window: it attends over the source's rows (and, caller-owned, its mask).

    `forward(x [B, T, D], input_pos [T']) -> [B, T, D]`, after the source ran on the same tokens. `x` may hold
    only the last `T <= T'` rows of the call (a model that needs only the last logits, as Gemma 4 does, runs the
    layers after its last source on those rows alone): nothing of this block is kept, so it computes them at
    their positions, the last `T` of `input_pos`.
    """

    def __init__(
        self,
        reads: KVShare,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        sdpa: SDPA,
        q_proj: nn.Module,
        o_proj: nn.Module,
        rope: RotaryEmbedding | None = None,
        q_norm: nn.Module | None = None,
        interleaved: bool | None = None,
    ) -> None:
        super().__init__(
            n_heads, n_kv_heads, head_dim, sdpa, None, q_proj, None, None, o_proj, rope=rope, q_norm=q_norm,
            interleaved=interleaved,
        )
        self.reads = reads

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, position_embeddings=None, kv=None, mask=None):
        if kv is not None:
            raise ValueError("a KVSharedAttention holds no state: bind the caches of the block it reads (its source)")
        bsz = x.shape[0]
        input_pos = input_pos[input_pos.shape[0] - x.shape[1] :]
        q = self.q_proj(x).view(bsz, -1, self.n_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q, _ = self.rotate(q, None, input_pos, position_embeddings)
        k_all, v_all, k_pos, source_mask = self.reads.read()
        y = self.attend(q, k_all, v_all, input_pos, k_pos, source_mask if mask is None else mask)
        return self.project_out(y.reshape(bsz, -1, self.n_heads * self.head_dim))
