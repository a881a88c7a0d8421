"""What the attention converters of every model kind share: the SDPA and cache a recipe picks for a layer."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.attention.sdpa import SDPA, CustomSDPA, DynamicSDPA, MaskedCustomSDPA, QuantizedCustomSDPA, StaticSDPA
from etblocks.state.io import IOKVCache
from etblocks.state.quantized import QuantizedIOKVCache, QuantizedKVCache, QuantizedRingKVCache
from etblocks.state.ring import RingKVCache
from etblocks.state.static import StaticKVCache
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
    never binds, and a full cache is both exact and smaller. `recipe.kv_quantize` picks the int8 form of each
    cache."""
    recipe = ctx.recipe
    int8 = recipe.kv_quantize is not None
    if window is not None and window >= ctx.max_seq_len:
        window = None
    if ctx.caller_owned:  # the program's caller owns the caches: a window only shortens the rows it keeps
        geometry = dict(max_seq_len=ctx.max_seq_len, window=window, dtype=recipe.dtype)
        io_cache = QuantizedIOKVCache(n_kv_heads, head_dim, **geometry) if int8 else IOKVCache(n_kv_heads, head_dim, **geometry)
        return StaticSDPA(scale, softcap, window), io_cache
    custom_sdpa = recipe.sdpa == "custom" and softcap is None and not has_sinks
    use_custom_op = recipe.cache_update == "custom"
    if window is not None:
        ring = (QuantizedRingKVCache if int8 else RingKVCache)(
            ctx.max_batch_size, window, n_kv_heads, head_dim, dtype, use_custom_op=use_custom_op, read_filled=custom_sdpa
        )
        return (MaskedCustomSDPA(scale, sliding_window=window) if custom_sdpa else DynamicSDPA(scale, softcap, window)), ring
    geometry = (ctx.max_batch_size, ctx.max_seq_len, n_kv_heads, head_dim, dtype)
    if int8:
        cache = QuantizedKVCache(*geometry, use_custom_op=use_custom_op, dequantize=not custom_sdpa)
        return (QuantizedCustomSDPA(scale) if custom_sdpa else DynamicSDPA(scale, softcap)), cache
    cache = StaticKVCache(*geometry, use_custom_op=use_custom_op)
    return (CustomSDPA(scale) if custom_sdpa else DynamicSDPA(scale, softcap)), cache
