"""What the converters of every model kind share: the SDPA and cache a recipe picks for a layer, and running a
block over the positions its caller gives, with its own cache or a caller-owned one."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from etblocks.attention.sdpa import SDPA, CustomSDPA, DynamicSDPA, StaticSDPA
from etblocks.kv_cache.io import IOKVCache
from etblocks.kv_cache.ring import RingKVCache
from etblocks.kv_cache.static import StaticKVCache
from etblocks.swap.registry import SwapContext


def sdpa_and_cache(
    scale: float,
    softcap: float | None,
    window: int | None,
    has_sinks: bool,
    n_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    ctx: SwapContext,
) -> tuple[SDPA, nn.Module]:
    """The recipe's SDPA and cache for one layer. A window no shorter than the context becomes a full cache: it
    never binds, and a full cache is both exact and smaller."""
    recipe = ctx.recipe
    if window is not None and window >= ctx.max_seq_len:
        window = None
    if recipe.cache == "io":  # the program's caller owns the caches: a window only shortens the mask it gives
        return StaticSDPA(scale, softcap, window), IOKVCache(n_kv_heads, head_dim)
    if window is not None:
        cache = RingKVCache(ctx.max_batch_size, window, n_kv_heads, head_dim, dtype)
        return DynamicSDPA(scale, softcap, window), cache
    cache = StaticKVCache(
        ctx.max_batch_size, ctx.max_seq_len, n_kv_heads, head_dim, dtype, use_custom_op=recipe.cache_update == "custom"
    )
    if recipe.sdpa == "custom" and softcap is None and not has_sinks:
        return CustomSDPA(scale), cache
    return DynamicSDPA(scale, softcap), cache


def run_block(
    forward: Callable, kv_cache: nn.Module | None, x: torch.Tensor, positions: torch.Tensor, position_embeddings=None
) -> torch.Tensor:
    """`forward(x [B, T, D], positions [T], position_embeddings)` of a block: with a caller-owned cache, the
    caches and mask bound by the static program go in and the new K/V rows go back to it."""
    if isinstance(kv_cache, IOKVCache):
        k_cache, v_cache, mask = kv_cache.bound()
        y, k_new, v_new = forward(x, positions, position_embeddings, kv=(k_cache, v_cache), mask=mask)
        kv_cache.emit(k_new, v_new)
        return y
    return forward(x, positions, position_embeddings=position_embeddings)
