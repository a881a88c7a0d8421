"""transformers causal LMs as a model kind: finding attention, calling the model, masks, MoE checks, metadata."""

from __future__ import annotations

import re

import torch
from torch import nn

from etblocks.errors import UnsupportedModelError
from etblocks.swap.hf.adapter import feed_positions
from etblocks.swap.hf.families import register_families
from etblocks.swap.hf.hybrid import is_state_layer
from etblocks.swap.hf.moe import MOE_FAMILIES, generic_experts_layout, is_generic_experts
from etblocks.swap.kinds import ModelKind

ATTN_IMPLEMENTATION = "etblocks"


def is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and hasattr(model, "config")


# Names of cross-attention modules (BART-style decoders' `encoder_attn`, BERT's `crossattention`).
CROSS_ATTENTION = re.compile(r"^(encoder_attn|crossattention|cross_attn|cross_attention)$")


def mixer_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost token mixers: attention, named `self_attn` (transformers' convention) or of a class named
    `...Attention` (what families with other names use, e.g. GPT-2's `attn`), and the state layers of hybrids
    (`etblocks.swap.hf.hybrid.is_state_layer`). An attention holding its mixer as `self` beside an `output` block
    (BERT and its kind) gives that inner module. Cross-attention is left upstream: a causal LM never calls it."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == outer or name.startswith(outer + ".") for outer, _ in found):
            continue
        if CROSS_ATTENTION.search(name.split(".")[-1]):
            continue  # reads an encoder's states, which a causal LM without an encoder never gives: never called
        if name.split(".")[-1] == "self_attn" or type(module).__name__.endswith("Attention") or is_state_layer(module):
            inner = getattr(module, "self", None)  # BERT's `attention`: the mixer is `attention.self`
            found.append((f"{name}.self", inner) if isinstance(inner, nn.Module) and hasattr(module, "output") else (name, module))
    return found


# transformers' experts kernels that export: `eager` loops over the experts a batch hit (data-dependent).
# workaround(executorch 1.5.1): `grouped_mm` is left out because it does not lower.
EXPORTABLE_EXPERTS = ("batched_mm",)


def unexportable_experts(model: nn.Module, replaced: list[str]) -> list[tuple[str, nn.Module, str | None]]:
    """transformers MoE experts modules (`@use_experts_implementation`) outside every replaced module, with an
    experts implementation that does not export: `(name, module, implementation)`."""
    found = []
    for name, module in model.named_modules():
        if not is_generic_experts(module):
            continue
        if any(name == outer or name.startswith(outer + ".") for outer in replaced):
            continue
        implementation = getattr(module.config, "_experts_implementation", None)
        if implementation not in EXPORTABLE_EXPERTS:
            found.append((name, module, implementation))
    return found


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


def token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class TransformersKind(ModelKind):
    """A transformers `PreTrainedModel` causal LM, called with `position_ids` so the blocks see absolute positions."""

    name = "transformers causal LM (PreTrainedModel)"
    positions_name = "config.max_position_embeddings"

    def matches(self, model: nn.Module) -> bool:
        return is_hf_causal_lm(model)

    def __init__(self) -> None:
        self._registered = False

    def prepare(self) -> None:
        if not self._registered:
            register_families()
            self._registered = True

    def mixer_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        return mixer_modules(model)

    def max_positions(self, model: nn.Module) -> int | None:
        return getattr(model.config, "max_position_embeddings", None)

    def module_layout(self, module: nn.Module):
        return generic_experts_layout(module)

    def vocab_size(self, model: nn.Module) -> int:
        return model.config.get_text_config().vocab_size

    def logits(self, model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, last_only: bool) -> torch.Tensor:
        return model(input_ids=tokens, position_ids=positions, use_cache=False, logits_to_keep=int(last_only)).logits

    def token_metadata(self, model: nn.Module) -> dict:
        config = model.config
        generation = getattr(model, "generation_config", None)
        eos = token_ids(getattr(generation, "eos_token_id", None)) or token_ids(getattr(config, "eos_token_id", None))
        bos = getattr(generation, "bos_token_id", None)
        if bos is None:
            bos = getattr(config, "bos_token_id", None)
        text = config.get_text_config()  # multimodal wrappers keep the language model's sizes there
        return {"vocab_size": text.vocab_size, "bos_id": bos, "eos_ids": eos, "n_layers": text.num_hidden_layers}

    def check(self, model: nn.Module, replaced: list[str]) -> None:
        """MoE experts left upstream must export through transformers' own kernel, or the export fails much later."""
        left = unexportable_experts(model, replaced)
        if left:
            name, module, implementation = left[0]
            raise UnsupportedModelError(
                f"{name} ({type(module).__name__}) is a transformers MoE experts module etblocks does not convert "
                f"(has_gate={module.has_gate}, has_post_expert_norm={module.has_post_expert_norm}), and "
                f"experts_implementation={implementation!r} does not export. MoE blocks etblocks converts (experts "
                f"it reads): {sorted(block for block, _ in MOE_FAMILIES.values())}; register a converter for its block with "
                f"etblocks.swap.registry.MODULES.register, or call model.set_experts_implementation("
                f"{EXPORTABLE_EXPERTS[0]!r}) to export transformers' own kernel (a per-token gather of the top-k "
                "experts, with the upstream router)."
            )

    def finish(self, model: nn.Module) -> None:
        skip_hf_masks(model)
        feed_positions(model)
