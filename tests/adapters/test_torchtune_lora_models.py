"""torchtune LoRA models (lora_llama3_2): `swap` keeps the base weights in the blocks and the LoRA weights as the
etblocks adapter "default", which export ships in its own file. Checked against torchtune's LoRA model with its
adapters on and off (`disable_adapter`): eager logits, and greedy tokens of the exported programs against
torchtune's `generate`. A torchtune LoRA checkpoint loads into a swapped base model by torchtune's module names."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_models import assert_untouched, prompt_ids, snapshot_of
from static_refs import eager_feeder
from torchtune_models import DIMS, LORA_ATTN, tiny_lora_model, tune_greedy, tune_logits

import etblocks
from etblocks.adapters import LoRALinear, adapter_names, set_adapter
from etblocks.adapters.files import adapter_tensors, read_adapter_file
from etblocks.errors import UnsupportedModelError
from torchtune.models.llama3_2._component_builders import llama3_2, lora_llama3_2
from torchtune.modules.peft import disable_adapter, get_adapter_state_dict
from torchtune.modules.peft import LoRALinear as TuneLoRALinear

LOGIT_ATOL = 1e-4
NEW_TOKENS = 32
N_LAYERS = 2
TARGETS = {f"layers.{i}.{part}" for i in range(N_LAYERS) for part in [*(f"attn.{p}" for p in LORA_ATTN), "mlp.w1", "mlp.w2", "mlp.w3"]}


def _swapped(backend: str = "xnnpack", **options):
    original = tiny_lora_model()
    return original, etblocks.swap(copy.deepcopy(original), backend=backend, max_seq_len=64, **options)


def _base_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with disable_adapter(model):
        return tune_logits(model, tokens)


def test_lora_model_becomes_base_blocks_plus_adapter():
    original, swapped = _swapped()
    assert not any(isinstance(m, TuneLoRALinear) for m in swapped.modules())
    assert adapter_names(swapped) == ["default"]
    assert {m.target for m in swapped.modules() if isinstance(m, LoRALinear)} == TARGETS
    tokens = prompt_ids(20)
    error = (tune_logits(swapped, tokens) - tune_logits(original, tokens)).abs().max().item()
    assert error <= LOGIT_ATOL, f"with the adapter: max abs logit error {error:.3g}"
    set_adapter(swapped, None)
    base_error = (tune_logits(swapped, tokens) - _base_logits(original, tokens)).abs().max().item()
    assert base_error <= LOGIT_ATOL, f"base: max abs logit error {base_error:.3g}"
    assert (tune_logits(original, tokens) - _base_logits(original, tokens)).abs().max() > 100 * LOGIT_ATOL


def test_qnn_recipe_splits_the_adapter_per_head():
    """Single-head attention: each q/k/v head computes its rows of lora_B; `output_proj` is the block's `o_proj`."""
    original, swapped = _swapped("qnn", chunk=8)
    heads = [m for n, m in swapped.named_modules() if isinstance(m, LoRALinear) and n.startswith("layers.0.attn.q_heads")]
    assert len(heads) == 4 and {m.target for m in heads} == {"layers.0.attn.q_proj"}
    assert swapped.layers[0].attn.o_proj.target == "layers.0.attn.output_proj"
    for adapter, reference in (("default", tune_logits), (None, _base_logits)):
        for length in (6, 13):
            prompt = prompt_ids(length)
            error = (_static_last_logits(swapped, prompt, adapter) - reference(original, prompt)[0, -1]).abs().max().item()
            assert error <= LOGIT_ATOL, f"adapter {adapter}, prompt of {length}: max abs logit error {error:.3g}"


def _static_last_logits(swapped, prompt: torch.Tensor, adapter: str | None) -> torch.Tensor:
    """The static program run eagerly as the Runner drives it, with `adapter`'s slots (None: the base)."""
    feeder = eager_feeder(swapped)
    feeder.adapter_inputs = feeder.contract.adapter_table.inputs(None if adapter is None else adapter_tensors(swapped, adapter))
    with torch.no_grad():
        return feeder.forward(prompt[0].tolist())


@pytest.mark.parametrize("backend", ["xnnpack", "qnn"])
def test_torchtune_checkpoint_loads_into_a_swapped_torchtune_model(backend, tmp_path):
    """What torchtune saves for a LoRA fine-tune (`adapter_model.pt`, torchtune keys; `adapter_config.json` from
    its HF checkpointer) loads by module name into the swapped base model, beside any other adapter."""
    lora = tiny_lora_model()
    torch.save(get_adapter_state_dict(lora.state_dict()), tmp_path / "adapter_model.pt")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    base = llama3_2(**DIMS, intermediate_dim=128).eval()
    base.load_state_dict({k: v for k, v in lora.state_dict().items() if "lora" not in k})
    swapped = etblocks.swap(base, backend=backend, max_seq_len=64, **({"chunk": 8} if backend == "qnn" else {}))
    assert set(etblocks.load_adapter(swapped, tmp_path, name="tuned")) == TARGETS
    prompt = prompt_ids(13)
    expected = tune_logits(lora, prompt)[0, -1]
    actual = tune_logits(swapped, prompt)[0, -1] if backend == "xnnpack" else _static_last_logits(swapped, prompt, "tuned")
    error = (actual - expected).abs().max().item()
    assert error <= LOGIT_ATOL, f"max abs logit error {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "qnn"])
def test_exported_adapter_file_switches_like_torchtune(backend, tmp_path):
    """XNNPACK's dynamic program (LoRA slots as buffers) and the qnn recipe's static one in fp32 (slots as
    inputs), both run here: one program, the adapter in `<stem>.default.ptd` keyed by torchtune's module names,
    switched on and off."""
    original, swapped = _swapped(backend)
    result = etblocks.export(swapped, backend="xnnpack", out=tmp_path / "lora.pte", quantize_activations=None)
    file = result.adapters["default"]
    assert file == tmp_path / "lora.default.ptd"
    assert set(read_adapter_file(file)) == TARGETS
    runner = etblocks.Runner(result.path, adapters={"default": file})
    prompt = prompt_ids(12)
    tokens = {}
    for adapter in ("default", None):
        runner.set_adapter(adapter)
        tokens[adapter] = runner.generate(prompt[0].tolist(), max_new_tokens=NEW_TOKENS)
    assert tokens["default"] == tune_greedy(original, prompt, NEW_TOKENS)
    assert tokens[None] == tune_greedy(original, prompt, NEW_TOKENS, base_only=True)
    assert tokens["default"] != tokens[None]


def _refused(model, match: str) -> None:
    snapshot = snapshot_of(model)
    with pytest.raises(UnsupportedModelError, match=match):
        etblocks.swap(model, max_seq_len=64)
    assert_untouched(model, snapshot)


def test_dora_model_is_refused():
    _refused(tiny_lora_model(use_dora=True), r"layers\.0\.attn\.q_proj is a DoRALinear; DoRA rescales")


def test_nf4_base_is_refused():
    """An NF4 base takes no in-place `normal_` (torchtune's own init does for a refusal) and blocks of 16384
    weights: 128 x 128 projections."""
    dims = {**DIMS, "embed_dim": 128, "num_kv_heads": 4}
    model = lora_llama3_2(LORA_ATTN, lora_rank=4, lora_alpha=8, quantize_base=True, **dims, intermediate_dim=128)
    _refused(model.eval(), r"layers\.0\.attn\.q_proj has an NF4-quantized base \(quantize_base=True\)")
