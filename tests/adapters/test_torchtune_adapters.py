"""torchtune LoRA checkpoints loaded by etblocks against torchtune's own LoRA model: the HF model with the adapter
gives the logits of the torchtune model it was trained in (fp32, atol 1e-5), untouched and swapped, for an
interleaved-rope family (llama3.2: q/k lora_B rows permuted) and an HF-rope one (qwen2: not permuted); adapters
that do not fit are refused with the model left as it was."""

from __future__ import annotations

import copy
import json
import shutil
import sys

import pytest
import torch
from hf_models import VOCAB, assert_untouched, prompt_ids, snapshot_of, tiny_model
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

import etblocks
from etblocks.adapters import load_adapter, set_adapter
from etblocks.errors import AdapterMismatchError, ConfigError
from etblocks.torchtune_compat import import_torchtune

import_torchtune()
from torchtune.models import convert_weights  # noqa: E402  (after the torchao shim)
from torchtune.models.llama3_2._component_builders import lora_llama3_2  # noqa: E402
from torchtune.models.qwen2._component_builders import lora_qwen2  # noqa: E402
from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf  # noqa: E402
from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names  # noqa: E402

ATOL = 1e-5
RANK, ALPHA = 4, 8
ATTN = ("q_proj", "k_proj", "v_proj", "output_proj")
DIMS = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128, max_seq_len=64)


def _hf_dims(dims: dict) -> dict:
    return dict(
        vocab_size=dims["vocab_size"], hidden_size=dims["embed_dim"], intermediate_size=dims["intermediate_dim"],
        num_hidden_layers=dims["num_layers"], num_attention_heads=dims["num_heads"],
        num_key_value_heads=dims["num_kv_heads"], head_dim=dims["embed_dim"] // dims["num_heads"], rms_norm_eps=1e-5,
    )


def llama3_2(dims: dict):
    """Interleaved rope: torchtune's Llama3ScaledRoPE (scale 32 over 8192 positions) is HF's llama3 rope type."""
    tune = lora_llama3_2(list(ATTN), apply_lora_to_mlp=True, lora_rank=RANK, lora_alpha=ALPHA, **dims)
    rope = dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = AutoConfig.for_model("llama", **_hf_dims(dims), tie_word_embeddings=True, max_position_embeddings=131072, rope_parameters=rope)
    return tune, config, convert_weights.tune_to_hf, False


def qwen2(dims: dict):
    """HF-style rope, q/k/v biases, untied output with its own LoRA."""
    tune = lora_qwen2(list(ATTN), apply_lora_to_mlp=True, apply_lora_to_output=True, lora_rank=RANK, lora_alpha=ALPHA, **dims)
    config = AutoConfig.for_model("qwen2", **_hf_dims(dims), tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6))
    return tune, config, qwen2_tune_to_hf, True


FAMILIES = {"llama3_2": llama3_2, "qwen2": qwen2}


def torchtune_and_hf(family: str, seed: int = 0, **dims):
    """The torchtune LoRA model with random base and LoRA weights (torchtune starts lora_b at zero), the HF model
    holding the same base weights (converted by torchtune), and whether LoRA covers the output layer."""
    torch.manual_seed(seed)
    tune, config, to_hf, lora_on_output = FAMILIES[family]({**DIMS, **dims})
    with torch.no_grad():
        for name, param in tune.named_parameters():
            param.normal_(0, 0.2 if "lora" in name else 0.3)
    base = {k: v for k, v in tune.state_dict().items() if "lora" not in k}
    hf = AutoModelForCausalLM.from_config(config).eval()
    result = hf.load_state_dict(to_hf(base, **_heads(config)), strict=False)
    assert not result.unexpected_keys and result.missing_keys == (["lm_head.weight"] if config.tie_word_embeddings else [])
    return tune.eval(), hf, lora_on_output


def _heads(config) -> dict:
    """The head sizes torchtune's HF checkpointer reads from config.json."""
    return dict(num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads, dim=config.hidden_size, head_dim=getattr(config, "head_dim", None))


def save_like_torchtune(tune, config, lora_on_output: bool, directory):
    """What torchtune 0.6.1's FullModelHFCheckpointer.save_checkpoint writes for the LoRA recipe's checkpoint
    dict: adapter_model.pt, its PEFT copy and the PEFT-form config. Written here with the same torchtune calls:
    the checkpointer itself cannot be imported with torchao 0.18 (torchtune.training imports TensorCoreTiledLayout)."""
    directory.mkdir()
    adapter = get_adapter_state_dict(tune.state_dict())
    torch.save(adapter, directory / "adapter_model.pt")
    peft_weights = convert_weights.tune_to_peft_adapter_weights(adapter, **_heads(config))
    save_file(peft_weights, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    recipe_config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": get_lora_module_names(list(ATTN), True, lora_on_output), "peft_type": "LORA"}
    (directory / "adapter_config.json").write_text(json.dumps(convert_weights.tune_to_peft_adapter_config(recipe_config)))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("torchtune")
    found = {}
    for family in FAMILIES:
        tune, hf, lora_on_output = torchtune_and_hf(family)
        found[family] = tune, hf, save_like_torchtune(tune, hf.config, lora_on_output, root / family)
    return found


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)  # torchtune's TransformerDecoder returns the logits tensor


@pytest.mark.parametrize("swapped", [False, True], ids=["upstream", "swapped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_matches_torchtune(checkpoints, family, swapped):
    tune, hf, directory = checkpoints[family]
    model = copy.deepcopy(hf)
    if swapped:
        etblocks.swap(model, backend="xnnpack", max_seq_len=64)
    names = load_adapter(model, directory, name="tune")
    assert len(names) == 2 * 7 + (family == "qwen2")  # q, k, v, o, gate, down, up per layer; qwen2 also lm_head
    tokens = prompt_ids(20)
    base_logits = _logits(hf, tokens)
    actual = _logits(model, tokens)
    assert (actual - _logits(tune, tokens)).abs().max().item() <= ATOL
    assert not torch.allclose(actual, base_logits, atol=ATOL), "the adapter must change the output"
    set_adapter(model, None)
    assert (_logits(model, tokens) - base_logits).abs().max().item() <= ATOL


def test_torchtunes_peft_copy_is_right_for_llama_and_permuted_for_qwen2(checkpoints, tmp_path):
    """Why `adapter_model.pt` wins over the PEFT copy next to it: torchtune 0.6.1 permutes qwen2's q/k rows too."""
    tokens = prompt_ids(20)
    for family, (tune, hf, directory) in checkpoints.items():
        peft_only = tmp_path / family
        peft_only.mkdir()
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(directory / file, peft_only / file)
        model = copy.deepcopy(hf)
        load_adapter(model, peft_only)
        diff = (_logits(model, tokens) - _logits(tune, tokens)).abs().max().item()
        assert diff <= ATOL if family == "llama3_2" else diff > 0.1, (family, diff)


def test_torchtune_adapters_that_do_not_fit_are_refused(checkpoints, tmp_path):
    _, hf, good = checkpoints["llama3_2"]
    model = copy.deepcopy(hf)
    snapshot = snapshot_of(model)

    def refused(directory, message):
        with pytest.raises(AdapterMismatchError, match=message):
            load_adapter(model, directory, name="X")

    for name, dims, message in [
        ("wider", dict(embed_dim=96), r"layers\.0\.attn\.q_proj\.lora_b\.weight is \[96, 4\]; the model's q_proj needs \[64, rank\]"),
        ("deeper", dict(num_layers=3), r"target module model\.layers\.2\.mlp\.down_proj is not in the model"),
    ]:
        tune, other, lora_on_output = torchtune_and_hf("llama3_2", **dims)
        refused(save_like_torchtune(tune, other.config, lora_on_output, tmp_path / name), message)

    def variant(name, weights=None, config=True):
        """`good` with its .pt replaced by `weights` (bytes or a state dict) and without its config if not `config`."""
        directory = tmp_path / name
        directory.mkdir()
        if config:
            shutil.copy(good / "adapter_config.json", directory)
        if isinstance(weights, bytes):
            (directory / "adapter_model.pt").write_bytes(weights)
        else:
            torch.save(weights, directory / "adapter_model.pt")
        return directory

    adapter = torch.load(good / "adapter_model.pt", weights_only=True)
    refused(variant("corrupt", b"\x00garbage" * 10), r"adapter_model\.pt could not be read as adapter weights")
    refused(variant("no_config", adapter, config=False), r"has adapter_model\.pt but no adapter_config\.json")
    refused(variant("foreign_key", {**adapter, "layers.0.attn.q_proj.lora_c.weight": torch.zeros(4, 64)}), r'unexpected key: "layers\.0\.attn\.q_proj\.lora_c\.weight"')
    refused(variant("dora", {**adapter, "layers.0.attn.q_proj.magnitude": torch.ones(64)}), r"layers\.0\.attn\.q_proj\.magnitude is a DoRA magnitude")
    refused(variant("not_a_dict", [1, 2]), r"holds a list, not a state dict of tensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, r"holds \[\]; expected a PEFT adapter directory .* or a torchtune checkpoint directory \(adapter_model\.pt \+ adapter_config\.json\)")
    assert_untouched(model, snapshot)

    for model_type, message in [
        ("qwen3", r"model_type='qwen3' has no torchtune 0\.6\.1 LoRA builder; accepted: \['gemma', 'gemma2', 'llama', 'mistral', 'qwen2'\]"),
        ("phi3", r"model_type='phi3' fuses q/k/v \(and gate/up\) into one projection"),
    ]:
        other = tiny_model(model_type)
        snapshot = snapshot_of(other)
        with pytest.raises(AdapterMismatchError, match=message):
            load_adapter(other, good)
        assert_untouched(other, snapshot)


def test_import_torchtune_is_idempotent_and_names_a_missing_package(monkeypatch):
    assert import_torchtune() is import_torchtune() is sys.modules["torchtune"]
    monkeypatch.setitem(sys.modules, "torchtune", None)  # what a missing package looks like to the import system
    with pytest.raises(ConfigError, match=r"need the package 'torchtune', which is not installed; pip install torchtune==0\.6\.1"):
        import_torchtune()
