"""Structural fallback for families without a registered converter but with the common HF attention layout."""

from __future__ import annotations

from torch import nn

from etblocks.swap.hf.convert import HFAttentionLayout

_NORM_NAMES = (("q_norm", "k_norm"), ("q_layernorm", "k_layernorm"), ("query_layernorm", "key_layernorm"))


def infer_layout(module: nn.Module) -> HFAttentionLayout | None:
    """A layout if `module` has linear q/k/v projections, an output projection (`o_proj`, or `out_proj` as LFM2
    names it), `head_dim`, `scaling` and `config`, else None.

    q/k norms are recognised by name; whether they act per head or over the full width is read off their
    weight size. Rope is taken from the `position_embeddings` the model passes in. What this cannot see
    (norm after rope, a different rope layout, extra gates) the probe check in `swap()` catches.
    """
    o_proj = "o_proj" if hasattr(module, "o_proj") else "out_proj"
    names = ("q_proj", "k_proj", "v_proj", o_proj)
    if not all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
        return None
    if not all(hasattr(module, a) for a in ("head_dim", "scaling", "config")):
        return None
    known = set(names) | {n for pair in _NORM_NAMES for n in pair}
    if any(name not in known for name, _ in module.named_children()):
        return None  # extra sub-modules (gates, sub-norms) mean extra computation this layout would drop
    extras = {
        "o_proj": o_proj,
        "softcap_attr": "attn_logit_softcapping" if hasattr(module, "attn_logit_softcapping") else None,
        "window_in_config": not hasattr(module, "sliding_window"),
    }
    for q_name, k_name in _NORM_NAMES:
        q_norm = getattr(module, q_name, None)
        if q_norm is None:
            continue
        weight = getattr(q_norm, "weight", None)
        per_head = weight is not None and weight.numel() == module.head_dim
        return HFAttentionLayout(qk_norm="head" if per_head else "full", q_norm=q_name, k_norm=k_name, **extras)
    return HFAttentionLayout(**extras)
