"""Structural fallback for families without a registered converter but with the common HF attention layout."""

from __future__ import annotations

import dataclasses

from torch import nn

from etblocks.attention.mha import GATE_ACTIVATIONS
from etblocks.swap.hf.convert import HFAttentionLayout, head_dim_of, out_features

_NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"), ("qk_norm", "qk_norm"))


# Names families give their q/k/v projections, and their output projection (None: the module has none, BERT's
# `attention.self`, whose `attention.output` projects, adds the residual and normalises after it).
_QKV_NAMES = (
    ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("Wq", "Wk", "Wv"),
    ("qkv_proj",), ("query_key_value",), ("c_attn",), ("Wqkv",),
)
_O_NAMES = ("o_proj", "out_proj", "dense", "c_proj", "Wo", None)
_GATE_NAMES = ("gate_proj", "g_proj")  # a projection gating the heads' output
_O_NORM_NAMES = ("attn_sub_norm",)  # a norm over the heads' output, before the output projection (BitNet)


def _is_gate(gate: nn.Module | None, module: nn.Module, qkv: tuple[str, ...]) -> bool:
    """Whether `gate` projects one gate per channel of the heads' output, or one per head."""
    width = out_features(getattr(module, qkv[0]))
    return _is_projection(gate) and out_features(gate) in (width, width // head_dim_of(module))


def _is_norm_of(norm: nn.Module | None, module: nn.Module, qkv: tuple[str, ...]) -> bool:
    """Whether `norm` is a norm with one weight per channel of the heads' output (all query heads)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return False
    width = module.config.num_attention_heads * head_dim_of(module) if len(qkv) == 1 else out_features(getattr(module, qkv[0]))
    return weight.shape == (width,)


def _is_projection(module: nn.Module | None) -> bool:
    """An `nn.Linear`, or transformers' `Conv1D` (GPT-2's projections: the same map, its weight transposed)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def infer_layouts(module: nn.Module) -> list[HFAttentionLayout]:
    """The layouts `module` may have, in order of likelihood, if it has q/k/v projections (`q_proj` or `query`
    ..., or one fused projection), at most one output projection (`o_proj`, `out_proj`, `dense`, `c_proj`, ...),
    a head size and `scaling` (and a `config` for a fused projection's head count); else none. A norm of the
    heads' output before the output projection (`attn_sub_norm`) is kept.

    q/k norms are recognised by name; whether they act per head (before or after rope) or over the full width is
    read off their weight size, or tried when they have no weight. Rope is taken from the `position_embeddings` the model passes in, in each pairing of dims a
    family may use (`ROPE_TABLES`): `swap` keeps the first layout its probe accepts, and refuses the module
    when none matches. An output gate from its own `gate_proj` or `g_proj` (per channel or per head, sigmoid or
    softplus) and per-head sink logits (`sinks [H]`) are kept.
    """
    qkv = next((names for names in _QKV_NAMES if all(_is_projection(getattr(module, n, None)) for n in names)), None)
    o_proj = next(name for name in _O_NAMES if name is None or _is_projection(getattr(module, name, None)))
    if qkv is None or head_dim_of(module) is None or not hasattr(module, "scaling"):
        return []
    if len(qkv) == 1 and not hasattr(module, "config"):
        return []  # the head count that splits a fused projection is read from the config
    gate_proj = next((name for name in _GATE_NAMES if len(qkv) == 3 and _is_gate(getattr(module, name, None), module, qkv)), None)
    o_norm = next((name for name in _O_NORM_NAMES if _is_norm_of(getattr(module, name, None), module, qkv)), None)
    known = {*qkv, o_proj, gate_proj, o_norm} | {n for pair in _NORM_NAMES for n in pair}
    if any(name not in known and not isinstance(child, nn.Dropout) for name, child in module.named_children()):
        return []  # extra sub-modules (gates, sub-norms) mean extra computation this layout would drop
    sinks = getattr(module, "sinks", None)
    extras = {
        "qkv": qkv,
        "o_proj": o_proj,
        "gate_proj": gate_proj,
        "o_norm": o_norm,
        "sinks_attr": "sinks" if isinstance(sinks, nn.Parameter) and sinks.ndim == 1 else None,
        "softcap_attr": "attn_logit_softcapping" if hasattr(module, "attn_logit_softcapping") else None,
        "window_in_config": not hasattr(module, "sliding_window"),
    }
    for q_name, k_name in _NORM_NAMES:
        if getattr(module, q_name, None) is None:
            continue
        norms = dict(q_norm=q_name, k_norm=k_name, **extras)
        weight = getattr(getattr(module, q_name), "weight", None)
        head = [HFAttentionLayout(qk_norm="head", **norms), HFAttentionLayout(qk_norm="head", qk_norm_after_rope=True, **norms)]
        full = [HFAttentionLayout(qk_norm="full", **norms)]
        if weight is None:  # a norm without weights could act per head (before or after rope) or over the width
            return [v for layout in head + full for v in _variants(layout)]
        return [v for layout in (head if weight.numel() == head_dim_of(module) else full) for v in _variants(layout)]
    return _variants(HFAttentionLayout(**extras))


# How the rotary tables a model passes pair a head's dims, most common first (see `HFCall`); "none": a layer that
# does not rotate (NoPE layers of hybrids of local and global attention).
ROPE_TABLES = ("halves", "halves_as_pairs", "pairs", "none", "halves_reversed")


def _variants(layout: HFAttentionLayout) -> list[HFAttentionLayout]:
    """`layout` in each rope pairing, a fused projection in each row layout, a gate with each activation."""
    rows = ("blocks", "heads") if len(layout.qkv) == 1 else ("blocks",)
    activations = GATE_ACTIVATIONS if layout.gate_proj else ("sigmoid",)
    return [
        dataclasses.replace(layout, rope_tables=tables, qkv_layout=r, gate_activation=activation)
        for activation in activations for r in rows for tables in ROPE_TABLES
    ]
