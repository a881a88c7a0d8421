"""Attention masks built from absolute positions, so every cache layout shares one rule."""

from __future__ import annotations

import torch


def allowed_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean `[T, S]`: query at `q_pos[t]` may read the key at `k_pos[s]`.

    A key is readable when it is filled (`k_pos >= 0`), not in the future, and, with a window W,
    fewer than W positions back (HF's `kv_idx > q_idx - W`).
    """
    q = q_pos[:, None]
    k = k_pos[None, :]
    allowed = (k >= 0) & (k <= q)
    if sliding_window is not None:
        allowed = allowed & (q - k < sliding_window)
    return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype = torch.float32, masked: float = float("-inf")) -> torch.Tensor:
    """`0` where allowed, `masked` (-inf; quantized programs use a finite value) elsewhere: the form static
    programs take as an input."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, masked)

