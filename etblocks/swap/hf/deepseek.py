"""DeepSeek V2/V3 multi-head latent attention (MLA) to `MLAttention`, with a cache that holds only the latent.

transformers 5.x caches the normed latent and the roped shared key but re-expands the whole cache through
`kv_b_proj` at every step; the block attends in the latent space instead (W_UK folded into the query, W_UV
applied after attention), so decode cost per cached token is `kv_lora_rank + qk_rope_head_dim` per head.
"""

from __future__ import annotations

import torch
from torch import nn

from etblocks.attention.mla import MLAttention, cos_sin_from_complex
from etblocks.state.io import IOKVCache
from etblocks.state.static import StaticKVCache
from etblocks.swap.hf import upstream_class
from etblocks.swap.hf.adapter import HFCall
from etblocks.swap.registry import MIXERS, MODULES, SwapContext


class HFMLAttention(HFCall, MLAttention):
    """An `MLAttention` called the transformers way. It takes `(cos, sin)` (V3, and V2 once its rotary module is
    swapped) or DeepSeek-V2's complex `freqs_cis`."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, *args, **kwargs):
        if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex():
            position_embeddings = cos_sin_from_complex(position_embeddings)
        return super().forward(hidden_states, position_embeddings, *args, **kwargs)


class RealRotaryEmbedding(nn.Module):
    """DeepSeek-V2's rotary table as real `(cos, sin)` `[B, T, R]` in the `cat(f, f)` layout instead of complex
    `freqs_cis`: ExecuTorch has no complex kernels (`aten::polar` is missing). Same frequencies and scaling."""

    def __init__(self, upstream: nn.Module) -> None:
        super().__init__()
        self.register_buffer("inv_freq", upstream.inv_freq, persistent=False)
        self.attention_scaling = upstream.attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def convert_mla(module: nn.Module, ctx: SwapContext) -> HFMLAttention:
    """The block over `module`'s own projections and norms (moved, not copied), with a latent cache."""
    recipe = ctx.recipe
    if recipe.attention == "sha":
        raise ValueError("MLA has no single-head form: its heads share one latent cache; use attention='mha'")
    if recipe.kv_quantize is not None:
        raise ValueError(f"kv_quantize={recipe.kv_quantize!r} does not cover MLA's latent cache; swap with kv_quantize=None")
    config = module.config
    rank, rope_dim = config.kv_lora_rank, config.qk_rope_head_dim
    dtype = module.kv_b_proj.weight.dtype
    if ctx.caller_owned:
        cache = IOKVCache(1, rank, v_head_dim=rope_dim, max_seq_len=ctx.max_seq_len, dtype=recipe.dtype)
    else:
        cache = StaticKVCache(
            ctx.max_batch_size, ctx.max_seq_len, 1, rank, dtype,
            use_custom_op=recipe.cache_update == "custom", v_head_dim=rope_dim,
        )
    block = HFMLAttention(
        n_heads=config.num_attention_heads,
        kv_lora_rank=rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=config.v_head_dim,
        scale=module.scaling,
        kv_a_proj=module.kv_a_proj_with_mqa,
        kv_a_norm=module.kv_a_layernorm,
        kv_b_proj=module.kv_b_proj,
        o_proj=module.o_proj,
        kv_cache=cache,
        q_proj=module.q_proj,
        q_a_proj=module.q_a_proj,
        q_a_norm=module.q_a_layernorm,
        q_b_proj=module.q_b_proj,
        rope_interleave=getattr(config, "rope_interleave", True),
    )
    block.layer_idx = module.layer_idx
    return block.to(module.kv_b_proj.weight.device)


MLA_FAMILIES = {"deepseek_v2": "DeepseekV2Attention", "deepseek_v3": "DeepseekV3Attention"}


def register_mla_families() -> None:
    for model_type, class_name in MLA_FAMILIES.items():
        MIXERS.register(upstream_class(model_type, class_name), replace=False)(convert_mla)
    MODULES.register(upstream_class("deepseek_v2", "DeepseekV2RotaryEmbedding"), same_output=False, replace=False)(lambda upstream, ctx: RealRotaryEmbedding(upstream))
