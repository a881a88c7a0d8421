"""PEFT adapters over the qnn recipe's single-head attention (per-head 1x1-conv views of q/k/v, a conv o_proj)
against `peft.PeftModel` on the untouched model.

An adapter on `q_proj` (or phi3's fused `qkv_proj`) lands on the head views as `LoRALinear`s that keep the
upstream `target` and their `rows`. The swapped static model, run eagerly on one chunk, gives PeftModel's
logits at every position with adapter A, B and none (fp32, atol 1e-4 as for the static SHA program without
adapters; measured <= 2e-5); merging writes PEFT's merged weight into each head's rows of the shared weight and
unmerging restores it; the exported static program, its LoRA slots filled from the adapter files at run time,
generates PeftModel's greedy tokens with A, B and none; the qnn program with an adapter is QNN-ready."""

from __future__ import annotations

import copy

import pytest
import torch
from attention_refs import causal_mask
from hf_models import FEW_HEADS, hf_greedy, prompt_ids, snapshot_of, tiny_model
from peft_refs import (
    SHARED_INPUT_GROUPS,
    first_layer_groups,
    make_adapter,
    make_adapters,
    peft_reference,
    peft_with,
    swapped_with,
)

import etblocks
from etblocks.adapters.files import adapter_tensors, save_adapter_file
from etblocks.adapters import LoRALinear, load_adapter, set_adapter
from etblocks.errors import AdapterMismatchError
from etblocks.export import check_readiness
from etblocks.state import IOKVCache

ATOL = 1e-4  # the static SHA program vs HF, as in tests/export/test_static_programs.py
CONTEXT, CHUNK = 64, 16
FAMILIES = {"llama": {}, "qwen3": {}, "phi3": dict(partial_rotary_factor=0.5)}  # phi3: one fused qkv_proj


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The untouched model and the directories of adapters A and B made for it."""
    name = request.param
    base = tiny_model(name, **FAMILIES[name])
    root = tmp_path_factory.mktemp(name)
    return base, make_adapters(base, root)


def eager_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """`[T, V]`: the qnn-swapped model run eagerly on one chunk from empty caller-owned caches, each IO cache bound
    to them and a causal mask as the static program binds its inputs."""
    blocks = [m for m in model.modules() if isinstance(getattr(m, "kv_cache", None), IOKVCache)]
    for block in blocks:
        empty = torch.zeros(1, 0, block.kv_cache.n_kv_heads, block.kv_cache.head_dim)
        block.kv_cache.bind((empty, empty), causal_mask(tokens.shape[1]))
    try:
        with torch.no_grad():
            return model(input_ids=tokens, position_ids=torch.arange(tokens.shape[1])[None], use_cache=False).logits[0]
    finally:
        for block in blocks:
            block.kv_cache.unbind()


def peft_logits(reference, tokens: torch.Tensor, adapter: str | None) -> torch.Tensor:
    with torch.no_grad(), peft_with(reference, adapter):
        return reference(tokens).logits[0]


def layers_by_target(model) -> dict[str, list[LoRALinear]]:
    """The `LoRALinear`s computing each upstream target, in row order."""
    layers: dict[str, list[LoRALinear]] = {}
    for layer in model.modules():
        if isinstance(layer, LoRALinear):
            layers.setdefault(layer.target, []).append(layer)
    return {target: sorted(parts, key=lambda layer: (layer.rows or (0, 0))[0]) for target, parts in layers.items()}


def target_weight(parts: list[LoRALinear]) -> torch.Tensor:
    """The upstream `[out, in]` weight, put back together from the layers computing its rows."""
    return torch.cat([layer.base.weight.reshape(layer.out_features, -1) for layer in parts])


def test_adapters_land_on_the_head_views(family):
    base, dirs = family
    model = swapped_with(base, dirs, "qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    attn, config = model.model.layers[0].self_attn, base.config
    heads, kv_heads, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    prefix = "model.layers.0.self_attn."
    if "qkv_proj" in attn.projection_parts:  # rows [q | k | v]
        expected = {"q_heads": ("qkv_proj", 0), "k_heads": ("qkv_proj", heads * dh)}
        expected["v_heads"] = ("qkv_proj", (heads + kv_heads) * dh)
    else:
        expected = {"q_heads": ("q_proj", 0), "k_heads": ("k_proj", 0), "v_heads": ("v_proj", 0)}
    for field, (target, start) in expected.items():
        for h, layer in enumerate(getattr(attn, field)):
            assert isinstance(layer, LoRALinear) and layer.target == prefix + target
            assert layer.rows == (start + h * dh, start + (h + 1) * dh)
    assert attn.o_proj.target == prefix + "o_proj" and attn.o_proj.rows is None
    reference = peft_reference(base, dirs)
    for target, parts in layers_by_target(model).items():
        peft_layer = reference.get_submodule(f"base_model.model.{target}")
        for adapter in parts[0].adapters:
            lora_B = torch.cat([layer.adapters[adapter].lora_B for layer in parts])
            assert torch.equal(lora_B, peft_layer.lora_B[adapter].weight), f"{target} {adapter}"
            assert all(torch.equal(layer.adapters[adapter].lora_A, peft_layer.lora_A[adapter].weight) for layer in parts)


def test_eager_logits_match_peft(family):
    base, dirs = family
    reference = peft_reference(base, dirs)
    model = swapped_with(base, dirs, "qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    tokens = prompt_ids(20)
    base_logits = peft_logits(reference, tokens, None)
    for adapter in ("A", "B", None):
        set_adapter(model, adapter)
        actual = eager_logits(model, tokens)
        error = (actual - peft_logits(reference, tokens, adapter)).abs().max().item()
        print(f"{adapter}: max abs diff {error:.2e}")
        assert error <= ATOL, adapter
        assert (adapter is None) == torch.allclose(actual, base_logits, atol=ATOL), "the adapter must change the output"


def test_merge_writes_each_head_rows(family):
    """Merged: every target's weight, put back together from its heads, is PEFT's merged weight; unmerged: the
    original weight."""
    base, dirs = family
    reference = peft_reference(base, dirs)
    model = swapped_with(base, dirs, "qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    set_adapter(model, "A")
    tokens = prompt_ids(20)
    unmerged = eager_logits(model, tokens)
    targets = layers_by_target(model)
    for parts in targets.values():
        for layer in parts:
            layer.merge()
    error = (eager_logits(model, tokens) - unmerged).abs().max().item()
    print(f"merged vs unmerged: max abs diff {error:.2e}")
    assert error <= 1e-4  # W + BA rounds once more than Wx + BAx
    for target, parts in targets.items():
        peft_layer = reference.get_submodule(f"base_model.model.{target}")
        original = peft_layer.base_layer.weight
        merged = original + peft_layer.get_delta_weight("A") if "A" in peft_layer.lora_A else original
        torch.testing.assert_close(target_weight(parts), merged, rtol=0, atol=1e-6, msg=target)
        for layer in parts:
            layer.unmerge()
        torch.testing.assert_close(target_weight(parts), original, rtol=0, atol=1e-6, msg=target)
    assert (eager_logits(model, tokens) - unmerged).abs().max().item() <= ATOL


@pytest.mark.parametrize("family", ["llama"], indirect=True)
def test_an_adapter_that_does_not_fit_a_head_changes_nothing(family, tmp_path):
    """q_proj and o_proj would fit; k_proj was made for 4 KV heads, not 2."""
    base, _ = family
    model = copy.deepcopy(base)
    etblocks.swap(model, backend="qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    modules, state = snapshot_of(model)
    more_kv_heads = tiny_model("llama", num_key_value_heads=4)
    make_adapter(more_kv_heads, tmp_path / "kv4", 0, r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"])
    message = r"self_attn\.k_proj has lora_A \(4, 64\), lora_B \(64, 4\); the model's 64 -> 32 layer at rank 4 needs"
    with pytest.raises(AdapterMismatchError, match=message):
        load_adapter(model, tmp_path / "kv4", name="K")
    assert {name: type(module) for name, module in model.named_modules()} == modules
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"], indirect=True)
def test_exported_program_with_adapters_matches_peft_generate(family, tmp_path):
    """The static program's LoRA slots over the head views take the adapter files (keyed by upstream target,
    sliced by rows) and switch between A, B and the base model at run time."""
    base, dirs = family
    reference = peft_reference(base, dirs)
    result = etblocks.export(swapped_with(base, dirs, "qnn", max_seq_len=CONTEXT, chunk=CHUNK), backend="xnnpack", out=tmp_path / "sha_lora.pte")
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    assert first_layer_groups(runner.adapter_table) == SHARED_INPUT_GROUPS  # every head view of q, k and v: one x @ A^T
    prompt = prompt_ids(13)
    for adapter in ("A", "B", None):
        runner.set_adapter(adapter)
        with peft_with(reference, adapter):
            expected = hf_greedy(reference, prompt, 32)
        assert (adapter is None) == (expected == hf_greedy(base, prompt, 32)), "the adapter must change the tokens"
        assert runner.generate(prompt[0].tolist(), max_new_tokens=32) == expected, adapter

    mha = swapped_with(base, dirs, max_seq_len=CONTEXT)  # another recipe, the same files
    for adapter, file in result.adapters.items():
        same = save_adapter_file(adapter_tensors(mha, adapter), tmp_path / f"mha.{adapter}.ptd")
        assert same.read_bytes() == file.read_bytes(), adapter


@pytest.mark.slow
def test_qnn_program_with_an_adapter_is_ready(tmp_path):
    base = tiny_model("llama", num_hidden_layers=1, **FEW_HEADS)  # a cheaper readiness check: see FEW_HEADS
    model = swapped_with(base, make_adapters(base, tmp_path), "qnn", max_seq_len=CONTEXT, chunk=CHUNK)
    set_adapter(model, "B")
    for method, readiness in check_readiness(model, "qnn").items():
        assert readiness.ready, method
        assert not readiness.uncovered and not readiness.bad_dtypes, method
