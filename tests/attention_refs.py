"""Reference pieces the attention tests share: weights for transformers attention modules, masks written
independently of etblocks' mask code, and the HF eager attention call they are compared with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Family:
    """A transformers attention family under test: its config, attention and rotary classes, the config
    overrides it is tested with, its q/k-norm layout and whether q/k/v are one fused projection."""

    name: str
    config_cls: type
    attention_cls: type
    rotary_cls: type
    config: dict
    layout: str = "head"
    fused: bool = False


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


def make_hf(family: Family, seed: int = 0, randomize: Callable[[nn.Module, int], None] | None = None, **sizes):
    """`(config, attention, rotary)`: layer 0 of `family` in eager mode with random weights (`randomize_weights`
    unless given). `sizes` override hidden 64, 4 heads, 2 KV heads."""
    sizes = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, **sizes}
    cfg = family.config_cls(**sizes, num_hidden_layers=1, pad_token_id=0, attn_implementation="eager", **family.config)
    attn = family.attention_cls(cfg, layer_idx=0).eval()
    (randomize or randomize_weights)(attn, seed)
    return cfg, attn, family.rotary_cls(cfg)


def additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean `[T, S]`: the key at `k_pos[s]` is not after the query at `q_pos[t]` (and, with a window W,
    fewer than W positions back)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < sliding_window
    return allowed


def causal_mask(seq: int, sliding_window: int | None = None) -> torch.Tensor:
    """`[T, T]`: 0 on and below the diagonal (within the window, if given), -inf elsewhere."""
    positions = torch.arange(seq)
    return additive(visible(positions, positions, sliding_window))


def io_mask(start: int, length: int, cache_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """`[T, S + T]` for a chunk at `start`: cache slot j holds position j for j < `start` (the rest are empty),
    the new rows hold positions `start, start + 1, ...`; causal, and within the window if given."""
    queries = torch.arange(start, start + length)
    slots = torch.arange(cache_len)
    empty = torch.iinfo(torch.long).max  # after every query: never visible
    keys = torch.cat((torch.where(slots < start, slots, empty), queries))
    return additive(visible(queries, keys, sliding_window))


def hf_attention(
    hf: nn.Module, x: torch.Tensor, position_embeddings, sliding_window: int | None = None
) -> torch.Tensor:
    """A transformers attention module over the whole sequence `x [B, T, D]` with HF's eager causal mask
    (sliding, if a window is given)."""
    positions = torch.arange(x.shape[1])
    allowed = visible(positions, positions, sliding_window)
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    out, _ = hf(hidden_states=x, position_embeddings=position_embeddings, attention_mask=mask)
    return out


def hf_forward(hf: nn.Module, rotary: nn.Module, x: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """`hf_attention` with the `(cos, sin)` the family's rotary module computes for positions `0..T-1`."""
    position_ids = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return hf_attention(hf, x, rotary(x, position_ids), sliding_window)
