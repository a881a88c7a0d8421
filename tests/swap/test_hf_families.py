"""Every registered family: swapped eager logits against untouched transformers; exported greedy tokens against
`generate` for a fixed subset, one family per path of the dynamic XNNPACK program (`EXPORTED`). Every family's export
is also in `benchmarks/support_matrix.py`'s sweep (its results make docs/transformers.md)."""

from __future__ import annotations

import pytest
import torch
from hf_models import FALLBACK_FAMILIES, FAMILIES, family_variant, hf_greedy, original_and_copy, prompt_ids, swapped_family

import etblocks
from etblocks.attention import CustomSDPA, DynamicSDPA, MaskedCustomSDPA
from etblocks.state import RingKVCache
from etblocks.swap.hf.adapter import HFCall, HFStateCall

LOGIT_ATOL = 1e-4  # fp32
NEW_TOKENS = 32
# The portable program differs from xnnpack's in lowering only: gemma2 (ring caches, softcaps) and phi3 (partial
# rotary, fused qkv) hold the ops llama's and qwen3's would add.
PORTABLE_FAMILIES = ("gemma2", "phi3")
MIXER_NAMES = ("self_attn", "linear_attn", "conv", "mamba")  # attention, gated DeltaNet, short convolution, Mamba2


def _eager_parity(name: str, families: dict) -> None:
    original, swapped = swapped_family(name, "xnnpack", families, max_seq_len=64)
    mixers = [m for layer in swapped.model.layers for n, m in layer.named_children() if n in MIXER_NAMES]
    assert len(mixers) == len(swapped.model.layers)
    assert all(isinstance(m, (HFCall, HFStateCall)) for m in mixers)
    tokens = prompt_ids(20)
    with torch.no_grad():
        expected = original(tokens).logits
        # Granite 4.0-H hands its layers no positions: the swapped model needs them given (what generate does).
        actual = swapped(tokens, position_ids=torch.arange(tokens.shape[1])[None]).logits
    error = (actual - expected).abs().max().item()
    assert error <= LOGIT_ATOL, f"{name}: max abs logit error {error:.3g}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_swapped_logits_match_upstream(name):
    _eager_parity(name, FAMILIES)


@pytest.mark.parametrize("name", sorted(FALLBACK_FAMILIES))
def test_structural_fallback_logits_match_upstream(name):
    _eager_parity(name, FALLBACK_FAMILIES)


# Families whose layers differ (sliding and full, NoPE, dense then MoE) export all their layers, the others one
# (~40% less export time each): their converters are what tells them apart, and the layered ones cover the
# loop over layers.
LAYERED = ("gemma2", "gemma3_text", "smollm3", "deepseek_v3", "gpt_oss", "qwen3_5_text", "gemma3n_text", "gemma4_text")


def export_family(name: str) -> dict:
    return FAMILIES if name in LAYERED else family_variant(name, num_hidden_layers=1)


def _exported_tokens_match(name: str, families: dict, backend: str, tmp_path) -> etblocks.ExportResult:
    original, swapped = swapped_family(name, backend, families, max_seq_len=64)
    result = etblocks.export(swapped, backend=backend, out=tmp_path / f"{name}.pte")
    prompt = prompt_ids(12)
    expected = hf_greedy(original, prompt, NEW_TOKENS)
    actual = etblocks.Runner(result.path).generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)
    assert len(set(expected)) > 4, "degenerate reference: the test would not tell models apart"
    assert actual == expected
    return result


# family -> what its dynamic XNNPACK program covers. The families left out add converter options that the eager
# parity above checks, or export elsewhere against `generate`: mistral and deepseek_v2 with a verify method
# (tests/export/test_speculation.py), mixtral and qwen2_moe with dense experts and qwen3_moe with gathered ones
# (tests/moe/test_moe_programs.py), every hybrid with LoRA slots (tests/export/test_hybrid_programs.py), gemma4's
# MoE variant statically (tests/export/test_kv_shared_programs.py). Gemma 3n's KV-shared layers and per-layer
# inputs are Gemma 4's too (AltUp and LAuReL are upstream's code, run as they are): its program is in
# `benchmarks/backend_matrix.py`, with every family on every backend.
EXPORTED = {
    "llama": "full attention: custom SDPA over a custom-op cache",
    "phi3": "fused qkv rows, partial rotary",
    "gemma2": "ring caches on every other layer, attention and final logit softcaps",
    "gemma3_text": "sliding and full layers in one program, q/k norms",
    "smollm3": "a NoPE layer beside rotary ones",
    "deepseek_v3": "latent attention (MLA) with a q LoRA, gathered experts behind a sigmoid router",
    "gpt_oss": "attention sinks over ring and full caches, gathered experts with biases and clamped SwiGLU",
    "qwen3_5_text": "gated DeltaNet state and gated attention",
    "gemma4_text": "KV-shared layers, per-layer input embeddings, keys as values on full layers, wider full-layer heads",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPORTED)
def test_xnnpack_greedy_matches_hf_generate(name, tmp_path):
    result = _exported_tokens_match(name, export_family(name), "xnnpack", tmp_path)
    assert result.delegation.ops_per_delegate.get("XnnpackBackend", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", PORTABLE_FAMILIES)
def test_portable_greedy_matches_hf_generate(name, tmp_path):
    result = _exported_tokens_match(name, export_family(name), "portable", tmp_path)
    assert result.delegation.partitions == []
    assert "llama.custom_sdpa" not in result.delegation.cpu_ops


@pytest.mark.slow
def test_fallback_family_exports(tmp_path):
    _exported_tokens_match("olmo3", FALLBACK_FAMILIES, "xnnpack", tmp_path)


def test_recipe_picks_blocks_per_layer():
    """xnnpack: custom SDPA on full layers; on sliding layers a ring cache written in place and read up to its filled
    slots, with custom SDPA under a mask from positions. portable: the plain-torch masked SDPA over the whole ring."""
    _, swapped = swapped_family("gemma3_text", "xnnpack", max_seq_len=64)
    sliding, full = (layer.self_attn for layer in swapped.model.layers)
    assert isinstance(sliding.kv_cache, RingKVCache) and sliding.kv_cache.window == FAMILIES["gemma3_text"][1]["sliding_window"]
    assert isinstance(sliding.sdpa, MaskedCustomSDPA)
    assert sliding.kv_cache.use_custom_op and sliding.kv_cache.read_filled
    assert isinstance(full.sdpa, CustomSDPA) and full.kv_cache.max_seq_len == 64
    _, portable = swapped_family("gemma3_text", "portable", max_seq_len=64)
    sliding = portable.model.layers[0].self_attn
    assert isinstance(sliding.sdpa, DynamicSDPA) and not (sliding.kv_cache.use_custom_op or sliding.kv_cache.read_filled)


def test_state_dict_keeps_upstream_names_and_shares_weights():
    original, swapped = original_and_copy("qwen3")
    before = {k: v.data_ptr() for k, v in swapped.state_dict().items()}
    etblocks.swap(swapped, backend="xnnpack", max_seq_len=32)
    after = {k: v.data_ptr() for k, v in swapped.state_dict().items()}
    assert after == before  # same keys, same storage: weights moved, not copied
    assert set(after) == set(original.state_dict())
