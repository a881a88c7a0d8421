"""PEFT LoRA adapters loaded by etblocks against `peft.PeftModel` itself: logits with adapter A, with B, and with
none equal PEFT's (fp32, within 1e-5 of the logits' scale), on the untouched and the swapped model; adapters that do
not fit are refused with the model left as it was."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_models import assert_untouched, prompt_ids, snapshot_of, tiny_model
from peft_refs import make_adapter, make_adapters, peft_reference, peft_with

import etblocks
from etblocks.adapters import LoRALinear, load_adapter, set_adapter
from etblocks.errors import AdapterMismatchError

ATOL = 1e-5


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    return base, make_adapters(base, root)


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("swapped", [False, True], ids=["upstream", "swapped"])
def test_adapters_match_peft(adapters, swapped):
    base, dirs = adapters
    reference = peft_reference(base, dirs)
    model = copy.deepcopy(base)
    if swapped:
        etblocks.swap(model, backend="xnnpack", max_seq_len=64)
    assert len(load_adapter(model, dirs["A"], name="A")) == 2 * 4
    assert len(load_adapter(model, dirs["B"], name="B")) == 2 * 7
    tokens = prompt_ids(20)
    base_logits = _logits(base, tokens)
    for name in ("A", "B", None):
        set_adapter(model, name)
        with peft_with(reference, name):
            expected = _logits(reference, tokens)
        actual = _logits(model, tokens)
        # relative to the logits' scale: the swapped model's SDPA rounds differently from eager attention
        assert (actual - expected).abs().max().item() <= ATOL * max(1.0, expected.abs().max().item()), name
        assert (name is None) == torch.allclose(actual, base_logits, atol=ATOL), "the adapter must change the output"


def test_user_scale_and_merge(adapters):
    base, dirs = adapters
    model = copy.deepcopy(base)
    load_adapter(model, dirs["A"], name="A", scale=0.0)
    tokens = prompt_ids(12)
    assert torch.allclose(_logits(model, tokens), _logits(base, tokens), atol=ATOL)  # scale 0 is the base

    model = copy.deepcopy(base)
    load_adapter(model, dirs["A"], name="A")
    unmerged = _logits(model, tokens)
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    before = [m.base.weight.clone() for m in layers]
    for layer in layers:
        layer.merge()
    assert (_logits(model, tokens) - unmerged).abs().max().item() <= 1e-4  # W + BA rounds once more than Wx + BAx
    with pytest.raises(ValueError, match="merged into the base; unmerge"):
        set_adapter(model, None)
    for layer, weight in zip(layers, before):
        layer.unmerge()
        assert torch.allclose(layer.base.weight, weight, atol=1e-6)


def test_adapters_that_do_not_fit_are_refused(adapters, tmp_path):
    base, dirs = adapters
    model = copy.deepcopy(base)
    snapshot = snapshot_of(model)

    wider = tiny_model("llama", hidden_size=96)  # another base: shapes differ
    make_adapter(wider, tmp_path / "wider", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterMismatchError, match=r"model\.layers\.0\.self_attn\.q_proj has lora_A \(4, 96\).*needs \(4, 64\)"):
        load_adapter(model, tmp_path / "wider", name="W")

    deeper = tiny_model("llama", num_hidden_layers=3)  # a target module this model lacks
    make_adapter(deeper, tmp_path / "deeper", 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(AdapterMismatchError, match=r"target module model\.layers\.2\.self_attn\.q_proj is not in the model"):
        load_adapter(model, tmp_path / "deeper", name="D")

    wrong_rank = tmp_path / "wrong_rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**json.loads((dirs["A"] / "adapter_config.json").read_text()), "r": 6}))
    (wrong_rank / "adapter_model.safetensors").write_bytes((dirs["A"] / "adapter_model.safetensors").read_bytes())
    with pytest.raises(AdapterMismatchError, match=r"down_proj has lora_A \(4, 128\).*config says rank 6"):
        load_adapter(model, wrong_rank, name="R")

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((dirs["A"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AdapterMismatchError, match=r"adapter_model\.safetensors could not be read as adapter weights"):
        load_adapter(model, corrupt, name="C")

    for key, value, message in [
        ("use_dora", True, r"use_dora=True: DoRA"),
        ("modules_to_save", ["lm_head"], r"modules_to_save=\['lm_head'\]"),
        ("bias", "all", r"bias='all': trained base biases are not supported; accepted: 'none'"),
    ]:
        refused = tmp_path / key
        refused.mkdir()
        config = {**json.loads((dirs["A"] / "adapter_config.json").read_text()), key: value}
        (refused / "adapter_config.json").write_text(json.dumps(config))
        (refused / "adapter_model.safetensors").write_bytes((dirs["A"] / "adapter_model.safetensors").read_bytes())
        with pytest.raises(AdapterMismatchError, match=message):
            load_adapter(model, refused, name="X")
    assert_untouched(model, snapshot)

    load_adapter(model, dirs["A"], name="A")
    with pytest.raises(AdapterMismatchError, match="already has an adapter named 'A'"):
        load_adapter(model, dirs["B"], name="A")
    with pytest.raises(etblocks.ConfigError, match=r"name='Z' is not a loaded adapter; loaded: \['A'\]"):
        set_adapter(model, "Z")
