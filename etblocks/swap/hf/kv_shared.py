"""Gemma 3n's and Gemma 4's text attention: value norms, keys that are also the values (Gemma 4's K=V layers),
and layers that read an earlier layer's keys and values.

The config marks each layer `kv_sharing_modes[i]`: "store" layers publish what they attended over, "reuse"
layers have no k/v projections and attend over the latest "store" layer of their kind (`layer_types[i]`), as
transformers' `shared_kv_states[layer_type]` does. Converted, a store layer's block publishes into a `KVShare` and
each reuse layer becomes a `KVSharedAttention` reading it: one cache per store layer in every program.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from etblocks.attention.sdpa import CustomSDPA, DynamicSDPA, QuantizedCustomSDPA
from etblocks.swap.blocks import sdpa_and_cache
from etblocks.swap.hf.adapter import HFKVSharedAttention, HFSingleHeadAttention
from etblocks.swap.hf.convert import HFAttentionLayout, attention_from_layout
from etblocks.swap.registry import SwapContext

# q/k norms per head, a weightless norm on each value head, keys and values cached after them.
VALUE_NORM = HFAttentionLayout(qk_norm="head", v_norm="v_norm")


def kv_source(module: nn.Module) -> int:
    """The layer whose keys and values reuse layer `module` reads: the last store layer of its kind before it."""
    config, index = module.config, module.layer_idx
    sources = [i for i in range(index) if config.kv_sharing_modes[i] == "store" and config.layer_types[i] == config.layer_types[index]]
    if not sources:
        raise ValueError(f"layer {index} reuses keys and values, but no earlier layer of type {config.layer_types[index]!r} stores them")
    return sources[-1]


def kv_shared_attention(module: nn.Module, ctx: SwapContext) -> nn.Module:
    """A Gemma 3n or Gemma 4 text attention module as an etblocks block: a `KVSharedAttention` for a reuse layer,
    else an attention block with its value norm (values from the keys where it has no `v_proj`) that, on a store
    layer, publishes its keys and values."""
    if not module.is_kv_shared_layer:
        keys_are_values = getattr(module, "v_proj", None) is None
        block = attention_from_layout(module, dataclasses.replace(VALUE_NORM, values_from_keys=keys_are_values), ctx)
        if module.store_full_length_kv:
            block.kv_share = ctx.kv_share(module.layer_idx)
        return block
    head_dim = module.head_dim
    n_heads = module.q_proj.out_features // head_dim
    n_kv_heads = n_heads // module.num_key_value_groups
    sdpa, _ = sdpa_and_cache(module.scaling, None, module.sliding_window, False, n_kv_heads, head_dim, module.q_proj.weight.dtype, ctx)
    if isinstance(sdpa, QuantizedCustomSDPA):
        raise ValueError("a layer that reads shared int8 keys and values through custom_quantized_sdpa; accepted: sdpa='dynamic'")
    if isinstance(sdpa, CustomSDPA):
        # The layer may get only the last rows of a call (Gemma 4 skips rows no logit needs): its start position is
        # then not the call's, which `custom_sdpa` takes as a number; masks from positions need none.
        sdpa = DynamicSDPA(sdpa.scale)
    block = HFKVSharedAttention(
        ctx.kv_share(kv_source(module)), n_heads, n_kv_heads, head_dim, sdpa, module.q_proj, module.o_proj, q_norm=module.q_norm
    )
    if ctx.recipe.attention == "sha":
        block = HFSingleHeadAttention.from_attention(block, conv2d=ctx.recipe.linear == "conv2d")
    block.layer_idx = module.layer_idx
    return block.to(module.q_proj.weight.device)
