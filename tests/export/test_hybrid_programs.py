"""Hybrid families (Qwen3.5 and Qwen3.5-MoE: gated DeltaNet + gated attention; LFM2: short convolutions + attention;
Granite 4.0-H: Mamba2 + attention, with or without MoE):
their state in the static contract, adapters, 8da4w, QNN readiness and the refusal of state layers etblocks does
not convert, against untouched transformers and PEFT.

They are `FAMILIES` entries: eager parity (and Qwen3.5's dynamic XNNPACK program without LoRA slots) is in
`tests/swap/test_hf_families.py`, the static programs (eager and exported, padded tails, save and restore) in
`tests/export/test_static_programs.py`; here, every hybrid's dynamic XNNPACK program with LoRA slots, an adapter
set and none. A padded call must leave the recurrent state as the real tokens left it:
padding rows carry position -1, which gated DeltaNet and Mamba2 neither decay nor write with.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import FEW_HEADS, HYBRID_FAMILIES, MOE, assert_untouched, family_pair, hf_greedy, prompt_ids, snapshot_of, tiny_model
from peft import PeftModel
from peft_refs import ADAPTERS, make_adapter
from quant_refs import assert_matches_torchao, hf_prefix_logits, linear_config, program_prefix_logits, torchao_quantized
from static_refs import CHUNK, CONTEXT, eager_feeder, swap_static

import etblocks
from etblocks.adapters.load import read_adapter
from etblocks.backends.qnn.readiness import format_readiness
from etblocks.errors import UnsupportedModelError
from etblocks.export import check_readiness
from etblocks.export.programs import static_program
from etblocks.moe import MoE
from etblocks.swap.hf.adapter import HFAttention, HFGatedDeltaNet, HFMamba2, HFShortConv

NEW_TOKENS = 32
PROMPT_LENGTHS = (16, 13, 5, 17)
LOGIT_ATOL = 1e-4
# Each state layer kind once, in its family's MoE form where it has one (the dense variants add no LoRA target a
# dense llama's adapter tests lack): Qwen3.5's DeltaNet, LFM2's short convolutions, Granite 4.0-H's Mamba2.
ADAPTED_HYBRIDS = ["granitemoehybrid", "lfm2", "qwen3_5_moe_text"]
# The first projection of each hybrid family's state layer: an all-linear adapter must land on it.
MIXER_PROJECTIONS = (("qwen", ".linear_attn.in_proj_qkv"), ("lfm2", ".conv.in_proj"), ("granite", ".mamba.in_proj"))


def test_contract_names_every_state_tensor():
    _, swapped = swap_static("qwen3_5_text", "openvino")
    contract = static_program(swapped).contract
    assert [(s.owner, s.name, s.update, s.mask) for s in contract.states] == [
        ("model.layers.0.linear_attn.conv_state", "conv_state", "window", None),
        ("model.layers.0.linear_attn.recurrent_state", "recurrent_state", "replace", None),
        ("model.layers.1.self_attn.kv_cache", "k_cache", "rows", "full"),
        ("model.layers.1.self_attn.kv_cache", "v_cache", "rows", "full"),
    ]
    assert contract.state_shapes()[:2] == [(1, 3, 2 * 2 * 16 + 4 * 8), (1, 4, 16, 8)]
    assert [s.skips_padding for s in contract.states] == [False, True, False, False]
    assert contract.paddable  # windows keep only real rows; the recurrent state skips padding


def test_padded_prefill_leaves_the_recurrent_state_as_the_real_tokens_did():
    """13 tokens as a chunk and a padded 5 leave the same states as 13 tokens one by one (no padding)."""
    _, swapped = swap_static("qwen3_5_text", "openvino")
    padded = eager_feeder(swapped)
    stepped = eager_feeder(swapped)
    stepped.decode_tail = CHUNK - 1  # every tail token through decode
    prompt = prompt_ids(13)[0].tolist()
    with torch.no_grad():
        padded.forward(prompt)
        stepped.forward(prompt[:CHUNK])
        for token in prompt[CHUNK:]:
            stepped.forward([token])
    assert padded.pos == stepped.pos == 13
    for entry, a, b in zip(padded.contract.states, padded.state, stepped.state):
        assert torch.allclose(a, b, atol=1e-5), entry.owner


@pytest.mark.slow
@pytest.mark.parametrize("name", ADAPTED_HYBRIDS)
def test_peft_adapter_switches_like_peft(name, tmp_path):
    """An all-linear PEFT adapter (gated DeltaNet's and short convolutions' projections included) in its own
    file over the base program: `set_adapter` gives PeftModel's tokens, `set_adapter(None)` the base's."""
    base, _ = family_pair(name, HYBRID_FAMILIES)
    make_adapter(base, tmp_path / "B", 1, **ADAPTERS["B"])
    model = etblocks.swap(copy.deepcopy(base), backend="xnnpack", max_seq_len=CONTEXT)
    etblocks.load_adapter(model, tmp_path / "B", name="B")
    adapted = {n for n, m in model.named_modules() if hasattr(m, "adapters") and "B" in m.adapters}
    mixer = next(projection for family, projection in MIXER_PROJECTIONS if name.startswith(family))
    assert any(n.endswith(mixer) for n in adapted), sorted(adapted)
    result = etblocks.export(model, backend="xnnpack", out=tmp_path / "model.pte")
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    reference = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "B", adapter_name="B").eval()
    prompt = prompt_ids(12)
    with_adapter = hf_greedy(reference, prompt, NEW_TOKENS)
    with reference.disable_adapter():
        without = hf_greedy(reference, prompt, NEW_TOKENS)
    assert with_adapter != without
    for adapter, expected in (("B", with_adapter), (None, without), ("B", with_adapter)):
        runner.set_adapter(adapter)
        runner.reset()
        assert runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS) == expected, adapter


@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2"])
def test_peft_adapter_on_single_head_blocks_matches_peft(name, tmp_path):
    """The qnn recipe splits q_proj per head (Qwen3.5: each head's query and gate rows) and renames LFM2's
    out_proj: an all-linear adapter still lands on every part, and the static program equals PeftModel."""
    base, _ = family_pair(name, HYBRID_FAMILIES)
    make_adapter(base, tmp_path / "B", 1, **ADAPTERS["B"])
    _, swapped = swap_static(name, "qnn")
    etblocks.load_adapter(swapped, tmp_path / "B", name="B")
    reference = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "B", adapter_name="B").eval()
    prompt = prompt_ids(13)
    feeder = eager_feeder(swapped)
    feeder.adapter_inputs = feeder.contract.adapter_table.inputs(read_adapter(swapped, tmp_path / "B"))
    with torch.no_grad():
        expected = reference(prompt).logits[0, -1]
        actual = feeder.forward(prompt[0].tolist())
    assert (actual - expected).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2"])
def test_8da4w_program_matches_torchao_eager(name, tmp_path):
    """Every linear (the mixers' projections too) in 8da4w: the program against torchao's eager quantization of
    the untouched model."""
    base, swapped = family_pair(name, HYBRID_FAMILIES)
    etblocks.swap(swapped, backend="xnnpack", max_seq_len=CONTEXT)
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / "q.pte", quantize_weights="8da4w", group_size=32)
    assert result.quantize.startswith("8da4w")
    reference = torchao_quantized(base, linear_config("8da4w", 32))
    assert_matches_torchao(program_prefix_logits(etblocks.Runner(result.path)), hf_prefix_logits(reference))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_text", "lfm2", "granitemoehybrid"])
def test_qnn_programs_are_fully_covered(name):
    """16a8w prefill and decode of one state layer and one attention layer: every op has a QNN builder (the
    chunked delta rule and Mamba2's static scan in matmuls and constant masks, no cumsum, triangular solve or
    int64; Granite's experts behind etblocks' router, whose dense form has no int64 indices)."""
    model_type, overrides = HYBRID_FAMILIES[name]
    model = tiny_model(model_type, **{**overrides, **FEW_HEADS})
    etblocks.swap(model, backend="qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    assert any(isinstance(m, (HFGatedDeltaNet, HFShortConv, HFMamba2)) for m in model.modules())
    report = check_readiness(model, "qnn")
    text = format_readiness(report)
    for method, readiness in report.items():
        assert readiness.ready, f"{name} {method}:\n{text}"
        assert not readiness.uncovered and not readiness.dynamic and not readiness.bad_dtypes


def test_families_with_the_same_layers_convert_by_layout():
    """LFM2-MoE has no layer converter of its own: its short convolutions convert by their layout, its attention by
    the structural fallback (`out_proj`, per-head q/k layer norms); its MoE block by its router's converter
    (sigmoid scores chosen with the block's expert bias), against upstream's exportable experts kernel."""
    original = tiny_model("lfm2_moe", **HYBRID_FAMILIES["lfm2"][1], num_experts=4, moe_intermediate_size=32, num_dense_layers=0, **MOE)
    original.set_experts_implementation("batched_mm")
    swapped = etblocks.swap(copy.deepcopy(original), backend="xnnpack", max_seq_len=CONTEXT)
    assert isinstance(swapped.model.layers[0].conv, HFShortConv)
    assert isinstance(swapped.model.layers[1].self_attn, HFAttention)
    assert isinstance(swapped.model.layers[0].feed_forward, MoE)
    prompt = prompt_ids(20)
    with torch.no_grad():
        assert (swapped(prompt).logits - original(prompt).logits).abs().max().item() <= LOGIT_ATOL


# Hybrids etblocks does not convert: Qwen3-Next's gated DeltaNet keeps q/k/v/z and b/a in two fused projections,
# OLMo-Hybrid's has separate q/k/v projections (in a decoder layer named after it); Jamba's layers are Mamba 1
# mixers.
UNCONVERTED = {
    "qwen3_next": (dict(HYBRID_FAMILIES["qwen3_5_moe_text"][1]), "Qwen3NextGatedDeltaNet"),
    "olmo_hybrid": ({}, "OlmoHybridGatedDeltaNet"),
    "jamba": (
        dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
             mamba_d_state=8, mamba_expand=1),
        "JambaMambaMixer",
    ),
}


@pytest.mark.parametrize("model_type", sorted(UNCONVERTED))
def test_unconverted_state_layers_are_refused_at_swap_time(model_type):
    overrides, layer_class = UNCONVERTED[model_type]
    model = tiny_model(model_type, **overrides)
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=f"model.layers.0.[a-z_]+ is a {layer_class}, a layer keeping recurrent"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=CONTEXT)
    assert_untouched(model, snapshot)


# Mamba2 mixers of other families (Granite 4.0-H's is a copy of Bamba's) convert by their layout.
MAMBA2_ATTRIBUTE = {"bamba": "mamba", "zamba2": "mamba", "nemotron_h": "mixer"}
MAMBA2_BY_LAYOUT = {
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_expand=1),
    "zamba2": dict(mamba_headdim=16, mamba_d_state=8, mamba_expand=1, n_mamba_heads=4, layers_block_type=["mamba", "hybrid"]),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, expand=1, hybrid_override_pattern="M*"),
}


@pytest.mark.parametrize("model_type", sorted(MAMBA2_BY_LAYOUT))
def test_mamba2_mixers_of_other_families_convert_by_layout(model_type):
    original = tiny_model(model_type, **MAMBA2_BY_LAYOUT[model_type])
    swapped = etblocks.swap(copy.deepcopy(original), backend="xnnpack", max_seq_len=CONTEXT)
    assert isinstance(swapped.get_submodule("model.layers.0").get_submodule(MAMBA2_ATTRIBUTE[model_type]), HFMamba2)
    prompt = prompt_ids(20)
    with torch.no_grad():
        actual = swapped(prompt, position_ids=torch.arange(20)[None]).logits
        assert (actual - original(prompt).logits).abs().max().item() <= LOGIT_ATOL


def test_mamba2_layout_with_other_numbers_is_refused():
    """Falcon-H1's mixer is laid out like Mamba2's but gates without a norm (and scales its projection): refused,
    naming why, and the model is left as it was."""
    model = tiny_model("falcon_h1", mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                       mamba_rms_norm=False)
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match="FalconH1Mixer.*not a gated RMSNorm"):
        etblocks.swap(model, backend="xnnpack", max_seq_len=CONTEXT)
    assert_untouched(model, snapshot)
