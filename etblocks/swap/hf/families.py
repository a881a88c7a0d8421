"""transformers families with a registered converter: one layout line each.

Decoder layers, dense MLPs and norms stay upstream; attention and the state layers of hybrids are replaced here
(their converters in `hybrid.py`), MLA in `deepseek.py`, MoE blocks in `moe.py`. A family is listed here once its
parity (eager logits and exported greedy tokens against upstream `generate`) is tested.
"""

from __future__ import annotations

from torch import nn

from etblocks.swap.hf import upstream_class
from etblocks.swap.hf.convert import HFAttentionLayout, attention_from_layout
from etblocks.swap.hf.deepseek import register_mla_families
from etblocks.swap.hf.hybrid import gated_deltanet, short_conv, text_rotary
from etblocks.swap.hf.kv_shared import VALUE_NORM, kv_shared_attention
from etblocks.swap.hf.moe import register_moe_families
from etblocks.swap.registry import MIXERS, MODULES, SwapContext

STANDARD = HFAttentionLayout()
HEAD_NORM = HFAttentionLayout(qk_norm="head")

# model_type -> (attention class name, layout)
FAMILIES: dict[str, tuple[str, HFAttentionLayout]] = {
    "llama": ("LlamaAttention", STANDARD),
    "mistral": ("MistralAttention", HFAttentionLayout(window_in_config=True)),
    "qwen2": ("Qwen2Attention", STANDARD),
    "qwen3": ("Qwen3Attention", HEAD_NORM),
    "gemma": ("GemmaAttention", STANDARD),
    "gemma2": ("Gemma2Attention", HFAttentionLayout(softcap_attr="attn_logit_softcapping")),
    "gemma3": ("Gemma3Attention", HFAttentionLayout(qk_norm="head", softcap_attr="attn_logit_softcapping")),
    "phi3": ("Phi3Attention", HFAttentionLayout(qkv=("qkv_proj",), window_in_config=True)),
    "smollm3": ("SmolLM3Attention", STANDARD),
    "olmo2": ("Olmo2Attention", HFAttentionLayout(qk_norm="full")),
    "granite": ("GraniteAttention", STANDARD),
    "stablelm": ("StableLmAttention", STANDARD),
    "exaone4": ("Exaone4Attention", HEAD_NORM),
    # Value norms; layers that reuse an earlier layer's keys and values (`kv_shared.py`).
    "gemma3n": ("Gemma3nTextAttention", VALUE_NORM),
    "gemma4": ("Gemma4TextAttention", VALUE_NORM),
    # Sinks, biases, per-layer `sliding_window` (None on full layers), half-width rope tables.
    "gpt_oss": ("GptOssAttention", HFAttentionLayout(sinks_attr="sinks", rope_tables="half_width")),
    "mixtral": ("MixtralAttention", HFAttentionLayout(window_in_config=True)),
    "qwen2_moe": ("Qwen2MoeAttention", STANDARD),
    "qwen3_moe": ("Qwen3MoeAttention", HEAD_NORM),
    "olmoe": ("OlmoeAttention", HFAttentionLayout(qk_norm="full", window_in_config=True)),
    # Hybrids: their state layers are in STATE_LAYERS.
    "lfm2": ("Lfm2Attention", HFAttentionLayout(o_proj="out_proj", qk_norm="head", q_norm="q_layernorm", k_norm="k_layernorm")),
    "qwen3_5": ("Qwen3_5Attention", HFAttentionLayout(qk_norm="head", output_gate=True)),
    "qwen3_5_moe": ("Qwen3_5MoeAttention", HFAttentionLayout(qk_norm="head", output_gate=True)),
}

# model_type -> (state layer class name, converter). Other families with these layouts convert structurally.
STATE_LAYERS = {
    "lfm2": ("Lfm2ShortConv", short_conv),
    "qwen3_5": ("Qwen3_5GatedDeltaNet", gated_deltanet),
    "qwen3_5_moe": ("Qwen3_5MoeGatedDeltaNet", gated_deltanet),
}

# StableLM's optional per-head LayerNorms expect `[B, H, T, D]`.
STABLELM_QK_NORM = HFAttentionLayout(qk_norm="heads_first", q_norm="q_layernorm", k_norm="k_layernorm")


def _exaone4(module: nn.Module, ctx: SwapContext) -> nn.Module:
    """EXAONE 4 stores the window on every layer but uses it, and rope, only on sliding layers (when it has any)."""
    block = attention_from_layout(module, HEAD_NORM, ctx)
    block.use_rope = module.sliding_window is None or module.is_sliding
    return block


def _stablelm(module: nn.Module, ctx: SwapContext) -> nn.Module:
    return attention_from_layout(module, STABLELM_QK_NORM if module.qk_layernorm else STANDARD, ctx)


def _olmoe(module: nn.Module, ctx: SwapContext) -> nn.Module:
    if module.config.clip_qkv is not None:
        raise ValueError(f"config.clip_qkv={module.config.clip_qkv} (clamping q/k/v) is not supported; accepted: None")
    return attention_from_layout(module, FAMILIES["olmoe"][1], ctx)


SPECIAL_CONVERTERS = {
    "gemma3n": kv_shared_attention, "gemma4": kv_shared_attention, "exaone4": _exaone4, "stablelm": _stablelm,
    "olmoe": _olmoe,
}


def _converter(layout: HFAttentionLayout):
    def convert(module: nn.Module, ctx: SwapContext) -> nn.Module:
        return attention_from_layout(module, layout, ctx)

    return convert


def register_families() -> None:
    """Register every family's converters (attention, MLA, MoE), by class name; never over a user's own."""
    register_mla_families()
    register_moe_families()
    for model_type, (class_name, layout) in FAMILIES.items():
        converter = SPECIAL_CONVERTERS.get(model_type) or _converter(layout)
        MIXERS.register(upstream_class(model_type, class_name), replace=False)(converter)
    for model_type, (class_name, converter) in STATE_LAYERS.items():
        MIXERS.register(upstream_class(model_type, class_name), replace=False)(converter)
    for model_type, class_name in (("qwen3_5", "Qwen3_5TextRotaryEmbedding"), ("qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding")):
        MODULES.register(upstream_class(model_type, class_name), replace=False)(text_rotary)
