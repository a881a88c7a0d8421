"""One tiny config for every model type in transformers' causal-LM auto mapping: the support matrix of etblocks
against every transformers causal LM (swap, export, token parity).

`MATRIX` maps a model type to its overrides of `hf_models.BASE`; every entry builds in well under 10 s with under
3M parameters, runs a forward on ids 3..127, and greedy-decodes 8 tokens with at least 3 distinct ids, transformers'
own cached `generate` agreeing with its uncached forward token for token. Sliding windows are shorter than the
12-token test prompts, and families with several kinds of layer get 2-4 layers covering each kind (state layers
first). `NOT_BUILDABLE` holds the types transformers itself cannot build or run as a tiny text-only causal LM here,
with the reason. Together they cover `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` exactly once.

Build through `tiny_config` / `tiny_matrix_model`: an override of `DROP` removes a `BASE` key the family's config
refuses (it is not settable there).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_models import BASE, DELTANET, WINDOW

DROP = "<drop>"  # remove this BASE key: the family's config raises when it is set


def _text(**overrides) -> dict:
    """A nested `text_config`: multimodal wrappers take their text sizes from it, not from the top level."""
    return {**BASE, **overrides}


SWA = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
UNTIED = dict(tie_word_embeddings=False)  # tied random embeddings make these greedy-decode one token forever
DECODER = dict(is_decoder=True)  # encoder-only families: causal self-attention, as their *ForCausalLM requires
# BART-style *ForCausalLM: the decoder stack only; no forced EOS on the last generated token.
BART_DECODER = dict(decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, forced_eos_token_id=None)

# Routed experts, 8 experts top-2, under the three naming schemes transformers uses.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
LOCAL_MOE = dict(num_local_experts=8, num_experts_per_tok=2)
ROUTED = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=1, topk_group=1
)
# Multi-head latent attention; head_dim is the rotary part.
MLA = dict(
    kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8,
    num_key_value_heads=4,
)
# DeepSeek sparse-attention indexer keeping 8 of the up-to-20 keys. 8 index heads: with 2, ReLU scores are often
# exactly 0, and the top-k tie-break then differs between cached and uncached runs.
INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=8)
# Mamba-2 mixers: 8 heads of 16 over hidden 64 (expand 2), chunked scan with chunks shorter than the prompt.
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8)
# Small vision towers for wrappers that build one (never run: the inputs are text only).
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)

GEMMA4_TEXT = dict(
    **SWA, **UNTIED, vocab_size_per_layer_input=128, hidden_size_per_layer_input=8,  # per-layer input embeddings
    global_head_dim=32, attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=2,
    moe_intermediate_size=32,
)
INKLING = dict(
    unpadded_vocab_size=128, layer_types=["hybrid_sliding", "hybrid"], sliding_window=WINDOW,
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16, rel_extent=8, n_routed_experts=8,
    num_experts_per_tok=2,
)
# Inkling 2 maps intermediate_size onto the experts' size; one layer per attention-residual block.
INKLING2 = dict(**INKLING, intermediate_size=32, n_layers_per_attn_res_block=1)
DOTS3 = dict(
    **MLA, **ROUTED, **INDEXER, layer_types=["sliding_attention", "indexed_attention"], sliding_window=WINDOW,
    # the sliding layers' own MLA sizes
    swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_q_lora_rank=24, swa_kv_lora_rank=32, swa_head_dim=24,
    swa_qk_nope_head_dim=16, swa_v_head_dim=12,
)
LLAMA4_TEXT = dict(
    num_local_experts=8, intermediate_size_mlp=128, attention_chunk_size=WINDOW, no_rope_layers=[1, 0]  # NoPE layer 1
)
QWEN3_5_MOE = dict(**DELTANET, **MOE, shared_expert_intermediate_size=48)
QWEN4_EXP = dict(
    **{**QWEN3_5_MOE, "layer_types": ["linear_attention", "indexed_attention"]}, hc_count=2, hc_lowrank=8,
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
)

MATRIX: dict[str, dict] = {
    "afmoe": dict(**MOE, num_shared_experts=1, num_dense_layers=1, **SWA),
    "apertus": {},
    "apertus1p5_text": {},
    "arcee": {},
    "aria_text": {},
    "axk1": dict(**MLA, **ROUTED),
    "axk2": dict(**MLA, **ROUTED, **INDEXER),
    "bailing_hybrid": dict(
        **MLA, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_expert_group=1, topk_group=1,
        first_k_dense_replace=1, linear_head_dim=16, linear_num_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "bamba": dict(attn_layer_indices=[1], **MAMBA2),
    "bart": BART_DECODER,
    "beam": dict(**MOE, n_group=1, topk_group=1, sliding_window=WINDOW, mlp_layer_types=["dense", "sparse"]),
    "bert": DECODER,
    "bert-generation": DECODER,
    "big_bird": dict(**DECODER, attention_type="original_full"),  # block-sparse attention needs long inputs
    "bigbird_pegasus": dict(**BART_DECODER, attention_type="original_full"),
    "biogpt": UNTIED,
    "bitnet": {},
    "blenderbot": BART_DECODER,
    "blenderbot-small": BART_DECODER,
    "bloom": {},
    "camembert": DECODER,
    "codegen": dict(rotary_dim=16),  # rotary dims must fit the 16-dim heads
    "cohere": {},
    "cohere2": SWA,
    "cohere2_moe": SWA,
    "cohere_compass_text": dict(
        **SWA,  # per-layer-type rope with multimodal sections over the 8 rotary frequencies
        rope_parameters={
            t: dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])
            for t in ("sliding_attention", "full_attention")
        },
    ),
    "ctrl": dict(dff=128, **UNTIED),
    "cwm": dict(sliding_window=WINDOW),
    "data2vec-text": dict(**DECODER, **UNTIED),
    "dbrx": dict(
        d_model=64,  # hidden_size reaches d_model only after ffn_config has copied the default d_model
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),  # clip_qkv=None crashes torch.clamp
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=8, moe_top_k=2),
    ),
    "deepseek_v2": dict(**MLA, **ROUTED, first_k_dense_replace=1),
    "deepseek_v3": dict(**MLA, **ROUTED, first_k_dense_replace=1),
    "deepseek_v32": dict(**MLA, **ROUTED, **INDEXER, first_k_dense_replace=1),
    "deepseek_v4": dict(
        num_hidden_layers=3, sliding_window=WINDOW,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, q_lora_rank=24, o_lora_rank=24, o_groups=2, index_n_heads=2, index_head_dim=16,
        index_topk=4, hc_mult=2,
    ),
    "diffllama": {},
    # keep_window_size (dynamic masking) shorter than the sequence makes cached generate disagree: left at 2048
    "doge": dict(sliding_window=WINDOW, is_moe=True, num_experts=16, num_experts_per_tok=2),
    "dory": dict(  # input, looped and output sections of one layer each
        num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "dots1": dict(**ROUTED, sliding_window=WINDOW, max_window_layers=1),  # layer 1 slides
    # text config from the top level (as published checkpoints store it); adapters must match the text width
    "dots3_note": dict(**DOTS3, vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64)),
    "dots3_note_text": DOTS3,
    "electra": DECODER,
    "emu3": dict(text_config=_text()),  # Emu3ForCausalLM is the text model alone
    "ergo": dict(**MOE, **SWA, first_dense_intermediate_size=128, shared_intermediate_size=32),  # NoPE full layer
    "ernie": DECODER,
    "ernie4_5": {},
    "ernie4_5_moe": dict(moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1),
    "exaone": {},
    "exaone4": SWA,
    "exaone_moe": dict(**SWA, **MOE),
    "falcon": dict(head_dim=DROP),  # a read-only property there
    "falcon_h1": dict(mamba_d_ssm=64, **{**MAMBA2, "mamba_n_heads": 4}),
    "falcon_mamba": {},
    "flex_olmo": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64),  # 128: a last-token near-tie
    "flint": dict(**MOE, **SWA, mlp_only_layers=[0]),
    "fuyu": {},
    "gemma": {},
    "gemma2": dict(sliding_window=WINDOW, **UNTIED),
    "gemma3": dict(text_config=_text(**SWA, **UNTIED), vision_config=VISION, mm_tokens_per_image=4, **UNTIED),
    "gemma3_text": dict(**SWA, **UNTIED),
    "gemma3n_text": dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=WINDOW,
        num_kv_shared_layers=2,  # layers 2-3 reuse the keys and values of layers 0-1
        vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, **UNTIED, initializer_range=1.0,
    ),
    "gemma4": dict(text_config=_text(**GEMMA4_TEXT), **UNTIED),
    "gemma4_text": GEMMA4_TEXT,
    "gemma4_unified": dict(text_config=_text(**SWA, **UNTIED, global_head_dim=32, attention_k_eq_v=True), **UNTIED),
    "gemma4_unified_text": dict(**SWA, **UNTIED, global_head_dim=32, attention_k_eq_v=True),
    "git": dict(vision_config=VISION),
    "glm": {},
    "glm4": {},
    "glm4_moe": ROUTED,
    "glm4_moe_lite": dict(**MLA, **ROUTED),
    "glm_moe_dsa": dict(**MLA, **ROUTED, **INDEXER, first_k_dense_replace=1, mlp_layer_types=["dense", "sparse"]),
    "got_ocr2": dict(
        text_config=_text(),
        vision_config=dict(
            hidden_size=32, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=64,
            patch_size=16, mlp_dim=64, window_size=2, global_attn_indexes=[0],
        ),
    ),
    "gpt-sw3": {},
    "gpt2": {},
    "gpt_bigcode": {},
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=WINDOW),
    "gpt_neox": {},
    "gpt_neox_japanese": {},
    "gpt_oss": dict(**LOCAL_MOE, intermediate_size=32, **SWA),
    "gptj": dict(rotary_dim=16),  # rotary dims must fit the 16-dim heads
    "granite": {},
    "granite_swa": dict(sliding_window=WINDOW),
    "granitemoe": {},
    "granitemoe_swa": dict(sliding_window=WINDOW),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"], shared_intermediate_size=64, **MAMBA2),
    "granitemoeshared": {},
    "helium": {},
    "hrm_text": {},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": dict(num_experts=8, moe_topk=2),
    "hy_v3": dict(**MOE, num_shared_experts=1),
    "hy_v4": dict(**MLA, **ROUTED, **INDEXER),
    "hyperclovax": {},
    "inkling2_loop_text": dict(**INKLING2, loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2,
                               loop_gate_rank=8),
    "inkling2_text": INKLING2,
    "inkling_text": dict(**INKLING, n_shared_experts=1, moe_intermediate_size=32, mlp_layer_types=["dense", "sparse"]),
    "internlm3": {},
    "iquestcoder": {},
    "jais2": {},
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, num_experts=8),  # mamba then attention + MoE
    "jetmoe": {},
    "kimi_linear": dict(
        **MLA, num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, linear_head_dim=16, linear_num_heads=4,
        layer_types=["linear_attention", "full_attention"],
    ),
    "kolibri1": dict(**LOCAL_MOE, moe_intermediate_size=32, shared_expert_intermediate_size=32, **SWA),
    "kolibri1_1": dict(  # layer 1: NoPE sparse attention over NVFP4-rounded keys, 4 of a pool of 8 (+1 sink, 2 local)
        **MOE, shared_expert_intermediate_size=32, sliding_window=WINDOW,
        layer_types=["sliding_attention", "indexed_attention"], mlp_only_layers=[0], mlp_only_intermediate_size=128,
        index_num_heads=2, index_topk=4, index_pool_size=8, index_compression=2, index_num_local_tokens=2,
        index_num_sink_tokens=1,
    ),
    "laguna": dict(**MOE, shared_expert_intermediate_size=32, **SWA),
    "lara_mini": dict(
        **MOE, shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, sliding_window=WINDOW,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(**MOE, num_dense_layers=1, layer_types=["conv", "full_attention"]),
    "lfm3": dict(
        num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"], sliding_window=WINDOW
    ),
    "llama": {},
    "llama4": dict(text_config=_text(**LLAMA4_TEXT)),  # Llama4ForCausalLM is the text model alone
    "llama4_text": LLAMA4_TEXT,
    "longcat_flash": dict(
        **MLA, n_routed_experts=8, moe_topk=2, zero_expert_num=2, expert_ffn_hidden_size=32, num_layers=1
    ),
    "mamba": {},
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=8),
    "marian": dict(**BART_DECODER, initializer_range=1.0),  # 0.3 (even untied) repeats one token
    "mbart": BART_DECODER,
    "megatron-bert": DECODER,
    "mellum": dict(**LOCAL_MOE, moe_intermediate_size=32, **SWA),
    "mimo_v2_flash": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, v_head_dim=16,
        sliding_window=WINDOW,
    ),
    "minicpm3": dict(**MLA, **UNTIED),
    "minicpm5_moe": ROUTED,
    # a sliding window makes MiniMax's cached generate disagree (its default has none); lightning blocks of 4 tokens
    "minimax": dict(layer_types=["linear_attention", "full_attention"], block_size=4),
    "minimax_m2": LOCAL_MOE,
    "minimax_m3_vl_text": dict(
        **LOCAL_MOE, dense_intermediate_size=128, shared_intermediate_size=32, rotary_dim=8,
        layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["dense", "sparse"],
        index_n_heads=2, index_head_dim=16, index_block_size=2, index_topk_blocks=2, index_local_blocks=1,
    ),
    "ministral": SWA,
    "ministral3": dict(sliding_window=WINDOW),
    "mistral": dict(sliding_window=WINDOW),
    "mixtral": dict(sliding_window=WINDOW),
    "mllama": dict(  # MllamaForCausalLM is the text model alone; layer 1 is a (skipped) cross-attention layer
        text_config=_text(num_hidden_layers=3, cross_attention_layers=[1], initializer_range=1.0),  # 0.3 repeats pad
    ),
    "modernbert-decoder": dict(sliding_window=WINDOW, local_attention=WINDOW),
    # MoshiModel masks fully causally but its DynamicCache(config) keeps only `sliding_window` keys: any window
    # shorter than the sequence makes cached generate disagree, so it spans max_position_embeddings
    "moshi": dict(sliding_window=256, ffn_dim=128),
    "moss_transcribe_diarize": dict(
        text_config=_text(),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    ),
    "mpt": {},
    "mvp": BART_DECODER,
    "nanochat": dict(num_key_value_heads=4),  # grouped KV heads make it greedy-decode the pad token forever
    "nemotron": {},
    "nemotron_h": dict(
        num_hidden_layers=4, layers_block_type=["mamba", "attention", "moe", "mlp"], mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=8, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
    ),
    "olmo": {},
    "olmo2": {},
    "olmo3": SWA,
    "olmo_hybrid": {},
    "olmoe": dict(num_experts=8, num_experts_per_tok=2),
    "openai-gpt": UNTIED,
    "opt": dict(ffn_dim=128),
    "param2moe": ROUTED,
    "pegasus": BART_DECODER,
    "persimmon": {},
    "phi": {},
    "phi3": dict(sliding_window=WINDOW),
    "phi4_multimodal": dict(
        sliding_window=WINDOW, vision_config=dict(**VISION, crop_size=28),
        audio_config=dict(
            hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, ext_pw_out_channel=32,
            depthwise_separable_out_channel=32, nemo_conv_channels=32,
        ),
    ),
    "phimoe": dict(sliding_window=WINDOW),
    "plbart": BART_DECODER,
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 1 slides
    "qwen2_moe": dict(**MOE, shared_expert_intermediate_size=48, use_sliding_window=True, sliding_window=WINDOW,
                      max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3_5": dict(text_config=_text(**DELTANET)),  # Qwen3_5ForCausalLM is the text model alone
    "qwen3_5_moe": dict(text_config=_text(**QWEN3_5_MOE)),
    "qwen3_5_moe_text": QWEN3_5_MOE,
    "qwen3_5_text": DELTANET,
    "qwen3_moe": dict(**LOCAL_MOE, moe_intermediate_size=32, use_sliding_window=True, sliding_window=WINDOW),
    "qwen3_next": QWEN3_5_MOE,
    "qwen4_exp": dict(text_config=_text(**QWEN4_EXP)),
    "qwen4_exp_text": QWEN4_EXP,
    "recurrent_gemma": dict(attention_window_size=WINDOW, block_types=["recurrent", "attention"], **UNTIED),
    # local (chunked) attention only: with an "lsh" layer transformers' generate crashes in einsum
    "reformer": dict(
        is_decoder=True, attn_layers=["local", "local"], local_attn_chunk_length=4, attention_head_size=16,
        axial_pos_shape=[16, 16], axial_pos_embds_dim=[32, 32], feed_forward_size=128,  # axial dims sum to hidden
    ),
    "rembert": DECODER,
    "roberta": dict(**DECODER, **UNTIED),
    "roberta-prelayernorm": DECODER,
    "roc_bert": dict(**DECODER, pronunciation_embed_dim=16, shape_embed_dim=16, shape_vocab_size=128,
                     pronunciation_vocab_size=128),
    "roformer": dict(**DECODER, **UNTIED),
    "rwkv": {},
    "sarvam_mla": dict(**MLA, **ROUTED),
    "sarvam_moe": ROUTED,
    "seed_oss": {},
    "smollm3": dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW),  # layer 3: NoPE, sliding
    "solar_open": ROUTED,
    "stablelm": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "trocr": dict(decoder_ffn_dim=128),
    "vaultgemma": dict(sliding_window=WINDOW),
    "whisper": BART_DECODER,
    "xglm": dict(ffn_dim=128),
    "xlm-roberta": DECODER,
    "xlm-roberta-xl": DECODER,
    # qk_dim_factor 0.5 (k heads narrower than v heads) fails generate's state shape check
    "xlstm": dict(num_heads=4, qk_dim_factor=1.0, chunk_size=4),
    "xmod": dict(**DECODER, default_language="en_XX"),
    "youtu": dict(**MLA, **UNTIED),
    "zamba": dict(  # hybrid layers share one transformer block, so two of them
        num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], attention_hidden_size=128,
        attention_head_dim=32, mamba_dt_rank=8, n_mamba_heads=2,
    ),
    "zamba2": dict(
        num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], mamba_d_state=16, n_mamba_heads=4,
        chunk_size=8,
    ),
    "zaya": dict(
        num_experts=4, moe_intermediate_size=32, router_hidden_size=32, layer_types=["hybrid_sliding", "hybrid"],
        sliding_window=WINDOW, **UNTIED,
    ),
}

NOT_BUILDABLE: dict[str, str] = {
    "blt": "cached generate disagrees with the uncached forward from the first decode step (logits differ by ~2.4): "
    "each call re-patches and re-hashes only the bytes it is given and runs the global transformer without a cache",
    "cpmant": "the forward attends bidirectionally (its context mask is all ones), so cached generate disagrees with "
    "the uncached forward from the first decode step",
    "gemma3n": "its vision tower is a TimmWrapperModel: needs the `timm` package, which is not installed",
    "gemma4_assistant": "a speculative-decoding drafter: forward ignores input_ids and raises 'inputs_embeds and "
    "shared_kv_states cannot be None' without the target model's states",
    "gemma4_unified_assistant": "a speculative-decoding drafter: forward ignores input_ids and raises 'inputs_embeds "
    "and shared_kv_states cannot be None' without the target model's states",
    "musicgen": "the auto mapping builds MusicgenForCausalLM from the composite MusicgenConfig (T5 + EnCodec + "
    "decoder): \"'MusicgenConfig' object has no attribute 'dropout'\"; the decoder models audio codebooks",
    "musicgen_melody": "the auto mapping builds MusicgenMelodyForCausalLM from the composite config: "
    "\"'MusicgenMelodyConfig' object has no attribute 'dropout'\"; the decoder models audio codebooks",
    "prophetnet": "cached generate disagrees with the uncached forward from the first decode step (logits differ by "
    "~3)",
    "xlm": "generate appends a mask token to every step's input and predicts it (prepare_inputs_for_generation), "
    "so it disagrees with the forward's next-token logits from the first token",
    "xlnet": "generate appends a dummy token under a permutation mask and predicts it, so it disagrees with the "
    "forward's next-token logits from the first token",
}


def config_kwargs(model_type: str) -> dict:
    """`BASE` merged with the family's overrides, `DROP` keys removed."""
    if model_type not in MATRIX:
        reason = NOT_BUILDABLE.get(model_type, "not a causal-LM model type of this transformers")
        raise KeyError(f"{model_type!r} has no tiny config: {reason}")
    return {k: v for k, v in {**BASE, **MATRIX[model_type]}.items() if not (isinstance(v, str) and v == DROP)}


def tiny_config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**config_kwargs(model_type), **overrides})


def tiny_matrix_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The matrix's tiny model of `model_type`, its config's keys updated with `overrides`."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
