"""Reference pieces the attention tests share: weights for transformers attention modules, masks written
independently of etblocks' mask code, and the HF eager attention call they are compared with."""

from __future__ import annotations

import torch
from torch import nn


def randomize_weights(module: nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform and norms are far from identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and name.endswith("weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def causal_mask(seq: int) -> torch.Tensor:
    """`[T, T]`: 0 on and below the diagonal, -inf above."""
    return additive(torch.ones(seq, seq, dtype=torch.bool).tril())


def io_mask(start: int, length: int, cache_len: int) -> torch.Tensor:
    """`[T, S + T]` for a chunk at `start`: cache slots `[0, start)` are filled, the new rows are causal."""
    filled = (torch.arange(cache_len) < start).expand(length, cache_len)
    return additive(torch.cat((filled, torch.ones(length, length, dtype=torch.bool).tril()), dim=1))


def hf_attention(hf: nn.Module, x: torch.Tensor, position_embeddings) -> torch.Tensor:
    """A transformers attention module over the whole sequence `x [B, T, D]` with HF's eager causal mask."""
    seq = x.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    mask = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, _ = hf(hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask)
    return out


def hf_forward(hf: nn.Module, rotary: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`hf_attention` with the `(cos, sin)` the family's rotary module computes for positions `0..T-1`."""
    position_ids = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return hf_attention(hf, x, rotary(x, position_ids))
