"""Model-level facts and hooks for transformers causal LMs: finding attention, probing, masks, metadata."""

from __future__ import annotations

import torch
from torch import nn

ATTN_IMPLEMENTATION = "etblocks"


def is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and hasattr(model, "config")


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules that are attention: named `self_attn` (transformers' convention) or of a class
    named `...Attention` (what families with other names use, e.g. GPT-2's `attn`)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if name.split(".")[-1] == "self_attn" or type(module).__name__.endswith("Attention"):
            found.append((name, module))
    return found


# transformers' experts kernels that export: `eager` loops over the experts a batch hit (data-dependent) and
# `grouped_mm` does not lower.
EXPORTABLE_EXPERTS = ("batched_mm",)


def unexportable_experts(model: nn.Module, replaced: list[str]) -> list[tuple[str, nn.Module, str | None]]:
    """transformers MoE experts modules (`@use_experts_implementation`) outside every replaced module, with an
    experts implementation that does not export: `(name, module, implementation)`."""
    found = []
    for name, module in model.named_modules():
        if not (hasattr(module, "is_concatenated") and hasattr(module, "has_gate") and hasattr(module, "config")):
            continue
        if any(name == outer or name.startswith(outer + ".") for outer in replaced):
            continue
        implementation = getattr(module.config, "_experts_implementation", None)
        if implementation not in EXPORTABLE_EXPERTS:
            found.append((name, module, implementation))
    return found


def max_positions(model: nn.Module) -> int | None:
    return getattr(model.config, "max_position_embeddings", None)


def _never_called(module, *args, **kwargs):
    raise RuntimeError(
        f"{type(module).__name__} was not swapped by etblocks but dispatched to the '{ATTN_IMPLEMENTATION}' "
        "attention implementation; swap() replaces every self_attn module, so this is a bug worth reporting"
    )


def skip_hf_masks(model: nn.Module) -> None:
    """Point the model at an attention implementation with no mask function, so no 4-D mask is ever built.

    etblocks blocks mask from positions themselves; transformers exits mask creation early for an
    implementation missing from `AttentionMaskInterface`.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _never_called)
    model.config._attn_implementation = ATTN_IMPLEMENTATION


@torch.no_grad()
def capture_calls(model: nn.Module, modules: list[nn.Module], tokens: torch.Tensor) -> dict[int, tuple]:
    """Run the untouched model once and record `(args, kwargs, output)` of each listed module, keyed by id."""
    calls: dict[int, tuple] = {}

    def record(module, args, kwargs, output):
        calls[id(module)] = (args, kwargs, output[0] if isinstance(output, tuple) else output)

    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in modules]
    try:
        model(input_ids=tokens, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
