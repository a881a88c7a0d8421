"""Build an etblocks attention block from a transformers attention module, moving (not copying) its weights."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from etblocks.attention.sha import ProjectionPart
from etblocks.swap.blocks import sdpa_and_cache
from etblocks.swap.hf.adapter import HFAttention, HFGatedAttention, HFSingleHeadAttention
from etblocks.swap.registry import SwapContext


@dataclass(frozen=True)
class HFAttentionLayout:
    """Where a family keeps each part of its attention.

    qkv: the names of its q, k and v projections, or of one fused projection (rows in `qkv_layout`: "blocks"
        `[q | k | v]`, or "heads" `[q_h | k_h | v_h]` per head).
    o_proj: the name of its output projection; None: it has none (another module projects its output).
    qk_norm: None, or "head" (norm over head_dim, before rope unless `qk_norm_after_rope`), "full" (over the
        whole projection width) or "heads_first" (a norm that expects `[B, H, T, D]`).
    window_in_config: the family reads `config.sliding_window` for every layer instead of a per-module attribute.
    sinks_attr: the per-head sink logits `[H]` (GPT-OSS), kept by the block under the same name.
    rope_tables: how the model lays out the `(cos, sin)` it passes and which dims they pair (see `HFCall`).
    output_gate: `q_proj` gives each head's query and a sigmoid gate on its output (`GatedAttention`: Qwen3.5).
    gate_proj: the name of a projection giving that gate instead (AFMoE), per channel or per head (LFM3).
    gate_activation: the gate's activation, "sigmoid" or "softplus" (Laguna).
    v_norm: the name of a norm on each value head, before the cache (Gemma 3n).
    values_from_keys: the module has no value projection; its values are the key projection's output (Gemma 4).
    o_norm: the name of a norm over the heads' output before the output projection (BitNet's `attn_sub_norm`).
    """

    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    o_proj: str | None = "o_proj"
    qk_norm: str | None = None
    q_norm: str = "q_norm"
    k_norm: str = "k_norm"
    softcap_attr: str | None = None
    window_in_config: bool = False
    sinks_attr: str | None = None
    rope_tables: str = "halves"
    qkv_layout: str = "blocks"
    qk_norm_after_rope: bool = False
    output_gate: bool = False
    gate_proj: str | None = None
    gate_activation: str = "sigmoid"
    o_norm: str | None = None
    v_norm: str | None = None
    values_from_keys: bool = False


def head_dim_of(module: nn.Module) -> int | None:
    """The head size, under the names families give it."""
    return next((size for name in ("head_dim", "attention_head_size", "head_size") if (size := getattr(module, name, None))), None)


def out_features(projection: nn.Module) -> int:
    """Output width of a projection: an `nn.Linear`, or a transformers `Conv1D` (GPT-2's, weight `[in, out]`)."""
    return projection.out_features if isinstance(projection, nn.Linear) else projection.nf


def sliding_window_of(module: nn.Module, layout: HFAttentionLayout) -> int | None:
    """The layer's window; families that store it on every layer mark the layers that use it `is_sliding`
    (EXAONE 4, Kolibri, Gemma 3)."""
    if getattr(module, "is_sliding", True) is False:
        return None
    if layout.window_in_config:
        return getattr(getattr(module, "config", None), "sliding_window", None)
    return getattr(module, "sliding_window", None)


def attention_from_layout(
    module: nn.Module, layout: HFAttentionLayout, ctx: SwapContext, sliding_window: int | None = ...
) -> HFAttention | HFSingleHeadAttention:
    """An `HFAttention` or `HFGatedAttention` (or, for `attention="sha"`, an `HFSingleHeadAttention`) holding
    `module`'s projections and norms, with cache and SDPA chosen by the recipe.

    `sliding_window` overrides what the layout reads (for families that decide per layer in code).
    """
    head_dim = head_dim_of(module)
    if len(layout.qkv) == 1:
        qkv_proj = getattr(module, layout.qkv[0])
        q_proj = k_proj = v_proj = None
        n_heads = module.config.num_attention_heads
        n_kv_heads = (out_features(qkv_proj) - n_heads * head_dim) // (2 * head_dim)
    else:
        qkv_proj = None
        q_proj, k_proj, v_proj = (getattr(module, name) for name in layout.qkv)
        v_proj = None if layout.values_from_keys else v_proj
        n_heads = out_features(q_proj) // (2 * head_dim if layout.output_gate else head_dim)
        n_kv_heads = out_features(k_proj) // head_dim
    window = sliding_window_of(module, layout) if sliding_window is ... else sliding_window
    softcap = getattr(module, layout.softcap_attr) if layout.softcap_attr else None
    sinks = getattr(module, layout.sinks_attr) if layout.sinks_attr else None
    weight = (qkv_proj if qkv_proj is not None else q_proj).weight
    sdpa, cache = sdpa_and_cache(
        module.scaling, softcap, window, sinks is not None, n_kv_heads, head_dim, weight.dtype, ctx
    )
    gated = layout.output_gate or layout.gate_proj is not None
    gate = {}
    if layout.gate_proj:
        gate_proj = getattr(module, layout.gate_proj)
        gate = dict(gate_proj=gate_proj, gate_per_head=out_features(gate_proj) == n_heads, gate_activation=layout.gate_activation)
    block = (HFGatedAttention if gated else HFAttention)(
        **gate,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        sdpa=sdpa,
        kv_cache=cache,
        q_proj=q_proj,
        k_proj=k_proj,
        v_proj=v_proj,
        qkv_proj=qkv_proj,
        o_proj=nn.Identity() if layout.o_proj is None else getattr(module, layout.o_proj),
        q_norm=getattr(module, layout.q_norm) if layout.qk_norm else None,
        k_norm=getattr(module, layout.k_norm) if layout.qk_norm else None,
        qk_norm_layout=layout.qk_norm or "head",
        sinks=sinks,
        interleaved=layout.rope_tables in ("pairs", "halves_as_pairs"),
        qkv_layout=layout.qkv_layout,
        qk_norm_after_rope=layout.qk_norm_after_rope,
        o_norm=getattr(module, layout.o_norm) if layout.o_norm else None,
        v_norm=getattr(module, layout.v_norm) if layout.v_norm else None,
        values_from_keys=layout.values_from_keys,
    )
    if ctx.recipe.attention == "sha":
        block = HFSingleHeadAttention.from_attention(block, conv2d=ctx.recipe.linear == "conv2d")
    if layout.o_proj not in ("o_proj", None):  # the block calls it o_proj; adapters (and users) name the upstream one
        block.projection_parts = {**getattr(block, "projection_parts", {}), layout.o_proj: [ProjectionPart("o_proj", None)]}
    block.layer_idx = getattr(module, "layer_idx", None)
    block.use_rope = bool(getattr(module, "use_rope", True)) and layout.rope_tables != "none"
    block.rope_tables = layout.rope_tables
    return block.to(weight.device)
