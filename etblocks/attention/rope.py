"""Rotary position embeddings: frequency tables and their application.

Two layouts pair a head's dims differently: rotate-half (HF) rotates dim i with dim i + D/2; interleaved (Meta's
original, torchtune's `RotaryPositionalEmbeddings`) rotates dims 2i and 2i + 1. Both are `x * cos + r(x) * sin`
with the tables and the partner map `r` in the same layout.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    """`1 / base^(2i / rotary_dim)` for i in [0, rotary_dim / 2)."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def llama3_inv_freq(
    rotary_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = default_inv_freq(rotary_dim, base)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Turns absolute positions `[T]` into `(cos, sin)` tables `[T, rotary_dim]`.

    `attention_scaling` multiplies both tables (YaRN-style schemes fold their magnitude correction in here).
    `interleaved=True` lays the tables out for interleaved pairs (`f0, f0, f1, f1, ...`); blocks with such a rope
    rotate with `rotate_pairs`.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0, interleaved: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.attention_scaling = attention_scaling
        self.interleaved = interleaved

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.stack((freqs, freqs), dim=-1).flatten(-2) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_half_matrix(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`R [dim, dim]` with `x @ R == rotate_half(x)`: one matmul instead of slices and a concat, which
    XNNPACK cannot delegate on a dynamic length. Exact: each output is one input times +-1."""
    half = dim // 2
    matrix = torch.zeros(dim, dim, dtype=dtype)
    matrix[torch.arange(half) + half, torch.arange(half)] = -1.0
    matrix[torch.arange(half), torch.arange(half) + half] = 1.0
    return matrix


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The interleaved partner of `x`: `(x0, x1, x2, x3, ...)` -> `(-x1, x0, -x3, x2, ...)`."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def rotate_pairs_matrix(dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`R [dim, dim]` with `x @ R == rotate_pairs(x)` (see `rotate_half_matrix`)."""
    even = 2 * torch.arange(dim // 2)
    matrix = torch.zeros(dim, dim, dtype=dtype)
    matrix[even + 1, even] = -1.0
    matrix[even, even + 1] = 1.0
    return matrix


def rotation_matrix(dim: int, interleaved: bool) -> torch.Tensor:
    """The partner map of a rope layout as a linear layer's weight: `F.linear(x, W) == r(x)`, the transpose of
    `rotate_pairs_matrix` or `rotate_half_matrix`. A linear takes `x [B, T, H, D]` as it is, where a matmul needs
    it viewed as rows and back: two operators fewer per rotation in an XNNPACK delegate."""
    return (rotate_pairs_matrix(dim) if interleaved else rotate_half_matrix(dim)).T.contiguous()


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotation: torch.Tensor | None = None, interleaved: bool = False
) -> torch.Tensor:
    """Rotate `x [B, T, H, D]` by `cos, sin [..., T, R]` with R <= D (partial rotary leaves dims R: untouched).

    `rotation` (`rotation_matrix(D, interleaved)`) replaces the slice-and-concat of a full rotation with a linear
    map; without it the layout is rotate-half. Interleaved tables need it; with R < D they rotate pairs of the
    first R dims (GLM), which the top-left `[R, R]` of the interleaved map does.
    """
    # Insert the head axis with a reshape that infers T: a plain unsqueeze of a dynamic length stays on CPU.
    table_shape = (*cos.shape[:-2], -1, 1, cos.shape[-1])
    cos = cos.reshape(table_shape).to(x.dtype)
    sin = sin.reshape(table_shape).to(x.dtype)
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        if rotation is None:
            rotated = rotate_half(x)
        else:
            rotated = F.linear(x, rotation)
        return x * cos + rotated * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    partner = F.linear(x_rot, rotation[:rotary_dim, :rotary_dim]) if interleaved else rotate_half(x_rot)
    return torch.cat((x_rot * cos + partner * sin, x_pass), dim=-1)
