"""torchtune attention as etblocks blocks: `MultiHeadAttention` and Gemma 2's `Gemma2Attention`, their rotary
modules, and the thin layer that takes torchtune's attention call."""

from __future__ import annotations

import torch
from torch import nn

from etblocks.attention.mha import Attention
from etblocks.attention.rope import RotaryEmbedding
from etblocks.attention.sha import ProjectionPart, SingleHeadAttention
from etblocks.errors import ConfigError
from etblocks.swap.blocks import sdpa_and_cache
from etblocks.swap.registry import SwapContext
from etblocks.swap.torchtune.lora import base_linear

# torchtune's rotary modules, by (module, class name): whether they rotate interleaved pairs. Every one keeps its
# frequencies in a `theta` buffer, which the block's rope takes as they are (scaling included).
ROPES = {
    ("torchtune.modules.position_embeddings", "RotaryPositionalEmbeddings"): True,
    ("torchtune.models.llama3_1._position_embeddings", "Llama3ScaledRoPE"): True,
    ("torchtune.models.qwen2._positional_embeddings", "Qwen2RotaryPositionalEmbeddings"): False,
    ("torchtune.models.phi3._position_embeddings", "Phi3RotaryPositionalEmbeddings"): False,
}

# torchtune calls the output projection `output_proj`; the blocks call it `o_proj`.
OUTPUT_PROJ = "output_proj"


class TuneCall:
    """Mixin: accept torchtune's self-attention call `attn(x, x, mask=None, input_pos=positions [1, T])` and run
    the mixer (`etblocks.state.mixer`) over those absolute positions with its own state (or caller-owned state
    bound by the static program).

    The block masks causally from positions, so it takes no mask. `cache_enabled = False` tells torchtune's
    decoder that torchtune's own cache protocol is off, so it asks for no mask either.
    """

    cache_enabled = False

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None, *, mask=None, input_pos: torch.Tensor | None = None
    ) -> torch.Tensor:
        if y is not x:
            raise ValueError("etblocks attention is self-attention: call it as attn(x, x), as torchtune's decoder layer does")
        if mask is not None:
            raise ValueError("etblocks attention masks causally from input_pos; mask must be None (packed or custom masks are not supported)")
        if input_pos is None or input_pos.shape[0] != 1:
            shape = None if input_pos is None else tuple(input_pos.shape)
            raise ValueError(f"etblocks attention needs the absolute positions input_pos [1, T] of one sequence; got {shape}")
        return super().forward(x, input_pos[0])

    def setup_cache(self, *args, **kwargs) -> None:
        """torchtune's `model.setup_caches()` lands here: the block already owns its cache."""
        raise ConfigError(
            "this attention was swapped by etblocks and owns its KV cache (etblocks.swap.set_max_seq_len resizes it); "
            "generate with the exported program and etblocks.Runner, or with torchtune on an unswapped copy"
        )


class TuneAttention(TuneCall, Attention):
    """An `Attention` block called the torchtune way. Projections keep torchtune's names except the output one
    (`o_proj` here); `projection_parts` maps `output_proj` onto it, so adapter targets still resolve."""


class TuneSingleHeadAttention(TuneCall, SingleHeadAttention):
    """A `SingleHeadAttention` block called the torchtune way (the qnn recipe's attention)."""


def rotary(pos_embeddings: nn.Module | None, head_dim: int, ropes: dict[type, bool]) -> RotaryEmbedding | None:
    """The block rope of a torchtune rotary module (None: no rotation)."""
    if pos_embeddings is None:
        return None
    interleaved = next((flag for cls, flag in ropes.items() if type(pos_embeddings) is cls), None)
    if interleaved is None:
        raise ValueError(
            f"pos_embeddings is a {type(pos_embeddings).__name__}; accepted rotary modules: {sorted(c.__name__ for c in ropes)}"
        )
    if pos_embeddings.dim != head_dim:
        raise ValueError(f"pos_embeddings rotates {pos_embeddings.dim} dims of head_dim={head_dim}; accepted: the whole head")
    return RotaryEmbedding(pos_embeddings.theta, interleaved=interleaved)


def attention_from_torchtune(
    module: nn.Module,
    ctx: SwapContext,
    ropes: dict[type, bool],
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> TuneAttention | TuneSingleHeadAttention:
    """A block holding `module`'s projections (a `LoRALinear`'s base; its LoRA is loaded back as an adapter),
    with the rope of its `pos_embeddings` and the recipe's SDPA and cache."""
    if module.kv_cache is not None:
        raise ValueError(
            "torchtune's KV cache is set up (model.setup_caches was called); etblocks blocks bring their own: "
            "swap a model without caches"
        )
    if module.q_norm is not None or module.k_norm is not None:
        raise ValueError("q_norm/k_norm (torchtune applies them after rope) are not supported; no torchtune 0.6.1 decoder uses them")
    if not module.is_causal:
        raise ValueError("is_causal=False (bidirectional attention) is not supported; etblocks decoders are causal")
    head_dim = module.head_dim
    q_proj, k_proj, v_proj, o_proj = (base_linear(getattr(module, name)) for name in ("q_proj", "k_proj", "v_proj", OUTPUT_PROJ))
    sdpa, cache = sdpa_and_cache(scale, softcap, window, False, module.num_kv_heads, head_dim, q_proj.weight.dtype, ctx)
    rope = rotary(module.pos_embeddings, head_dim, ropes)
    block = TuneAttention(module.num_heads, module.num_kv_heads, head_dim, sdpa, cache, q_proj, k_proj, v_proj, o_proj, rope=rope)
    parts = {OUTPUT_PROJ: [ProjectionPart("o_proj", None)]}
    if ctx.recipe.attention == "sha":
        block = TuneSingleHeadAttention.from_attention(block, conv2d=ctx.recipe.linear == "conv2d")
        parts.update(block.projection_parts)
    block.projection_parts = parts
    return block.to(q_proj.weight.device)


def multi_head_attention(ropes: dict[type, bool]):
    """The converter of torchtune's `MultiHeadAttention` (scores scaled by `1 / sqrt(head_dim)`)."""

    def convert(module: nn.Module, ctx: SwapContext) -> nn.Module:
        return attention_from_torchtune(module, ctx, ropes, scale=module.head_dim**-0.5)

    return convert


def gemma2_attention(ropes: dict[type, bool]):
    """The converter of torchtune's `Gemma2Attention`: its own scale, score softcap and per-layer window."""

    def convert(module: nn.Module, ctx: SwapContext) -> nn.Module:
        return attention_from_torchtune(
            module, ctx, ropes, scale=module.scaling, softcap=module.softcapping, window=module.sliding_window_size
        )

    return convert
