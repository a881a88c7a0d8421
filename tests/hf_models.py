"""Tiny transformers models with random weights, one config per family, shared by the tests."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import etblocks

VOCAB = 128
WINDOW = 6  # sliding windows are shorter than every test prompt

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,  # no EOS: greedy runs always produce the full token count on both sides
    initializer_range=0.3,  # the 0.02 default makes tiny random models repeat one token
)

MLA = dict(
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8, num_key_value_heads=4,
    first_k_dense_replace=2,
)

# Routed experts: 8 experts, top-2, small experts so the MoE families stay tiny.
MOE = dict(num_experts_per_tok=2)

# name -> (model_type, overrides). Each entry exercises what that family adds over llama.
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama3_rope": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "mistral": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, attention_bias=True)),
    "qwen3": ("qwen3", {}),
    "gemma": ("gemma", {}),
    # Untied: with tied random embeddings gemma2/3 greedy-decode one token forever.
    "gemma2": (
        "gemma2",
        dict(sliding_window=WINDOW, attn_logit_softcapping=5.0, final_logit_softcapping=10.0, tie_word_embeddings=False),
    ),
    "gemma3_text": (
        "gemma3_text",
        dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False),
    ),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),
    "smollm3": ("smollm3", dict(num_hidden_layers=4)),  # layer 3 is a NoPE layer
    "olmo2": ("olmo2", {}),
    "granite": (
        "granite",
        dict(embedding_multiplier=2.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0),
    ),
    "stablelm": ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True)),
    "exaone4": ("exaone4", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    # MLA, one dense layer then a MoE layer with a shared expert. V2: softmax router limited to the best of 2
    # groups by max score, routed scaling. V3: low-rank queries, interleaved YaRN rope with mscale != 1, sigmoid
    # router over 2 groups choosing 1 by their best two, renormalised and scaled.
    "deepseek_v2": (
        "deepseek_v2",
        dict(
            q_lora_rank=None, **{**MLA, "first_k_dense_replace": 1},
            n_routed_experts=8, moe_intermediate_size=32, n_group=2, topk_group=1, n_shared_experts=1,
            topk_method="group_limited_greedy", routed_scaling_factor=1.5, **MOE,
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            q_lora_rank=24,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
            ),
            **{**MLA, "first_k_dense_replace": 1},
            n_routed_experts=8, moe_intermediate_size=32, n_group=2, topk_group=1, n_shared_experts=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, **MOE,
        ),
    ),
    # MoE: softmax top-k renormalised (mixtral, qwen3_moe) or not (olmoe, qwen2_moe with a gated shared expert);
    # GPT-OSS: router bias, clamped SwiGLU experts with biases, attention sinks, a sliding and a full layer.
    "mixtral": ("mixtral", dict(num_local_experts=8, intermediate_size=64, **MOE)),
    "qwen2_moe": (
        "qwen2_moe",
        dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, qkv_bias=True, **MOE),
    ),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True, **MOE)),
    "olmoe": ("olmoe", dict(num_experts=8, intermediate_size=32, **MOE)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_local_experts=8, intermediate_size=32, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], **MOE,
        ),
    ),
}

# Hybrids: a state layer (gated DeltaNet, short convolution) then full attention, layer types set explicitly (with
# no attention layer transformers' own generate fails). Convolution windows (3-4 taps) are shorter than every
# test prompt; Qwen3.5's v heads are twice its k heads.
DELTANET = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
)
MAMBA2 = dict(
    mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
    shared_intermediate_size=48, layer_types=["linear_attention", "full_attention"],
)
HYBRID_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3_5_text": ("qwen3_5_text", DELTANET),
    "qwen3_5_moe_text": (
        "qwen3_5_moe_text", dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, **DELTANET, **MOE)
    ),
    "lfm2": ("lfm2", dict(conv_L_cache=3, layer_types=["conv", "full_attention"])),
    # Granite 4.0-H: Mamba2 mixers (4 heads in 2 groups, upstream chunk 8 so prompts span several) then attention;
    # with MoE experts beside the shared MLP and rope, or dense with NoPE attention (Granite 4.0-H's own choice).
    "granitemoehybrid": (
        "granitemoehybrid", dict(num_local_experts=8, intermediate_size=32, position_embedding_type="rope", **MAMBA2, **MOE)
    ),
    "granitemoehybrid_dense": ("granitemoehybrid", dict(num_local_experts=0, **MAMBA2)),
}
FAMILIES.update(HYBRID_FAMILIES)

# KV sharing: four layers, sliding then full, twice; layers 2-3 reuse the keys and values of layers 0-1 (the last
# of their kind that stores them). Per-layer input embeddings on. Gemma 4: full layers with a wider head whose keys
# are also its values (K=V), and a variant with its MoE block beside the MLP (router with per-expert scales).
KV_SHARING = dict(
    num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
    num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, tie_word_embeddings=False,
)
GEMMA4 = dict(**KV_SHARING, global_head_dim=32, attention_k_eq_v=True)
KV_SHARED_FAMILIES: dict[str, tuple[str, dict]] = {
    "gemma3n_text": ("gemma3n_text", dict(**KV_SHARING, initializer_range=1.0)),
    "gemma4_text": ("gemma4_text", GEMMA4),
    "gemma4_text_moe": ("gemma4_text", dict(**GEMMA4, enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)),
}
FAMILIES.update(KV_SHARED_FAMILIES)

# QNN readiness (QnnQuantizer calibration, then QNN's own pass pipeline) costs ~0.35 s per graph node on CI's
# machines, and the qnn recipe's single-head attention makes a set of nodes per query head, so the readiness tests
# use 2 query heads over 1 KV head (still grouped): llama's check took 165 s with BASE, 56 s with this and 1 layer.
FEW_HEADS = dict(num_attention_heads=2, num_key_value_heads=1)

# Families with no registered converter that the structural fallback handles.
FALLBACK_FAMILIES: dict[str, tuple[str, dict]] = {
    "olmo": ("olmo", {}),
    "starcoder2": ("starcoder2", {}),
    "olmo3": ("olmo3", dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
}


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def original_and_copy(model_type: str, **overrides):
    """The untouched upstream model and a deep copy to swap."""
    original = tiny_model(model_type, **overrides)
    return original, copy.deepcopy(original)


def family_pair(name: str, families: dict = FAMILIES):
    """The untouched model of the family entry `name` and a deep copy to swap."""
    model_type, overrides = families[name]
    return original_and_copy(model_type, **overrides)


def family_variant(name: str, **overrides) -> dict:
    """A families table holding only `name`, its config overrides updated with `overrides`."""
    model_type, entry = FAMILIES[name]
    return {name: (model_type, {**entry, **overrides})}


def swapped_family(name: str, backend: str, families: dict = FAMILIES, **swap_options):
    """`family_pair` with the copy swapped for `backend` (`max_seq_len`, recipe options in `swap_options`)."""
    original, swapped = family_pair(name, families)
    etblocks.swap(swapped, backend=backend, **swap_options)
    return original, swapped


def prompt_ids(length: int = 12, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (1, length), generator=generator)


def hf_greedy(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, prompt.shape[1] :].tolist()


def hf_log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """`[len(ids) - 1]`: transformers' log-probability of each token given those before it (one forward)."""
    with torch.no_grad():
        log_probs = model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return log_probs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


SCORE_ATOL = 1e-4  # fp32 programs' log-probabilities against transformers' (their logits agree to ~1e-5)


def snapshot_of(model: torch.nn.Module):
    """Module types by name and a copy of the state dict: what `assert_untouched` compares against."""
    return {name: type(module) for name, module in model.named_modules()}, {
        k: v.clone() for k, v in model.state_dict().items()
    }


def assert_untouched(model: torch.nn.Module, snapshot) -> None:
    """Same modules, same values, not marked swapped: a refused call changed nothing."""
    modules, state = snapshot
    assert {name: type(module) for name, module in model.named_modules()} == modules
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert getattr(model, "etblocks_swap", None) is None


# Text the tests train their tokenizers on (test_stock_runner.py, test_text.py).
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a small model learns to export itself to a phone",
    "tokens flow through the cache one position at a time",
    "every test asserts something that can fail",
    "greedy decoding picks the most likely next token",
    "rotary embeddings turn positions into angles",
    "grouped query attention shares keys between heads",
    "the runner reads metadata methods before it loads the forward method",
    "weights are moved, not copied, when a block replaces an upstream module",
    "a sliding window keeps memory proportional to the window size",
    "quantized linear layers trade accuracy for speed on mobile devices",
    "prefill feeds the whole prompt at once and decode feeds one token",
    "zebras, jackets and vivid quizzes mix unusual letters",
]
