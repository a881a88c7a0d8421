"""Reading torchtune LoRA checkpoints: `adapter_model.pt` (torchtune keys) + `adapter_config.json`.

What torchtune 0.6.1 writes to `<output_dir>/epoch_<n>/` for a LoRA fine-tune:
- `FullModelHFCheckpointer`: `adapter_model.pt` (torchtune keys, e.g. `layers.0.attn.q_proj.lora_a.weight`), the
  same tensors in PEFT form as `adapter_model.safetensors` (`.bin` without safe serialization) and
  `adapter_config.json` in PEFT form (`r`, `lora_alpha`, `target_modules` in HF names, `peft_type`,
  `base_model_name_or_path`). For phi3/phi4 (and llama3.2 vision) only `adapter_model.pt`.
- `FullModelTorchTuneCheckpointer`, `FullModelMetaCheckpointer`: `adapter_model.pt` only, no config.

Into a torchtune model (swapped or not) the `.pt` keys map as they are: `<module>.lora_a.weight` adapts
`<module>`. Into a transformers model they are converted as torchtune's HF checkpointer would:

The PEFT copy is made by `convert_weights.tune_to_peft_adapter_weights`, which permutes the q/k `lora_B` rows from
torchtune's interleaved rope order into HF's rotate-half order for every family, qwen2 included, although
torchtune's qwen2 builders use HF-style rope (its base-weight converter `qwen2_tune_to_hf` does not permute). So
the `.pt` file is read here, with the permutation decided by the model's family, and then handed to the PEFT
reader. The scaling is `alpha / rank` (torchtune has no rsLoRA).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from etblocks.adapters.lora import LoRATensors
from etblocks.adapters.peft import CONFIG_FILE, layer_tensors, read_config
from etblocks.errors import AdapterMismatchError
from etblocks.torchtune_compat import import_torchtune, is_torchtune_decoder

WEIGHT_FILE = "adapter_model.pt"
_TUNE_PART = re.compile(r"\.lora_([ab])\.weight$")  # torchtune's lora_a/lora_b are PEFT's lora_A/lora_B
# HF model_type -> whether torchtune's builders for that family use interleaved rope (RotaryPositionalEmbeddings,
# Llama3ScaledRoPE), so q/k lora_B rows need permuting into HF order, or HF-style rope (qwen2, qwen2.5).
INTERLEAVED_ROPE = {"llama": True, "mistral": True, "gemma": True, "gemma2": True, "qwen2": False}
FUSED_QKV = ("phi3",)  # torchtune's phi3 adapts q/k/v and w1/w3 apart; HF fuses them into qkv_proj/gate_up_proj


def is_torchtune_dir(path: Path) -> bool:
    """torchtune's own adapter file is there (every checkpointer writes it; only the HF one adds a PEFT copy)."""
    return (path / WEIGHT_FILE).is_file()


def read_torchtune_adapter(model: nn.Module, path: str | Path) -> dict[str, LoRATensors]:
    """`{module name: LoRATensors}` of the torchtune LoRA checkpoint directory `path` for `model`: a torchtune
    decoder takes torchtune's module names; a transformers model gets HF names, converted (its config gives the
    family and the head sizes the q/k rows are permuted with). Refused with
    `AdapterMismatchError`: no `adapter_config.json`, a family torchtune's keys cannot be mapped onto, DoRA, keys
    that are not torchtune LoRA keys, q/k rows that do not fit the model's heads, a corrupt file."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise AdapterMismatchError(
            f"{path} has {WEIGHT_FILE} but no {CONFIG_FILE}, which gives the LoRA alpha (torchtune's TorchTune and Meta "
            f'checkpointers write none); write one from the fine-tune\'s config: {{"r": <lora_rank>, "lora_alpha": <lora_alpha>}}'
        )
    config = read_config(path)
    weights = _read_weights(path / WEIGHT_FILE)
    if is_torchtune_decoder(model):
        return layer_tensors(config, {_TUNE_PART.sub(_peft_part, key): tensor for key, tensor in weights.items()}, path)
    return layer_tensors(config, _to_peft(weights, model, path / WEIGHT_FILE), path)


def _peft_part(match: re.Match) -> str:
    return f".lora_{match[1].upper()}.weight"


def _read_weights(file: Path) -> dict[str, torch.Tensor]:
    try:
        weights = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: the unpickler raises many types
        raise AdapterMismatchError(f"{file} could not be read as adapter weights: {exc}") from None
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise AdapterMismatchError(f"{file} holds a {type(weights).__name__}, not a state dict of tensors as torchtune saves adapters")
    if not weights:
        raise AdapterMismatchError(f"{file} holds no tensors")
    dora = sorted(k for k in weights if k.endswith(".magnitude"))
    if dora:
        raise AdapterMismatchError(f"{file}: {dora[0]} is a DoRA magnitude; only plain LoRA is supported")
    return weights


def _to_peft(weights: dict[str, torch.Tensor], model: nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """The adapter in PEFT form, converted by torchtune itself (HF names, q/k lora_B rows in HF rope order)."""
    config = _text_config(model, file)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows = {"q_proj": heads * head_dim, "k_proj": kv_heads * head_dim}
    _check_rope_rows(weights, rows, file)
    if not INTERLEAVED_ROPE[config.model_type]:
        # torchtune permutes q/k rows within each head; in heads of 2 rows (one rotary pair) no row moves
        heads, kv_heads, head_dim = rows["q_proj"] // 2, rows["k_proj"] // 2, 2
    import_torchtune()
    from torchtune.models import convert_weights

    try:
        return convert_weights.tune_to_peft_adapter_weights(weights, num_heads=heads, num_kv_heads=kv_heads, dim=config.hidden_size, head_dim=head_dim)
    except Exception as exc:  # torchtune raises a bare Exception naming the key it cannot map
        raise AdapterMismatchError(f"{file}: {exc}") from None


def _text_config(model: nn.Module, file: Path):
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise AdapterMismatchError(f"{file}: a torchtune adapter is loaded into a transformers model (its config names the family and head sizes); got a {type(model).__name__}")
    config = config.get_text_config()
    if config.model_type in FUSED_QKV:
        raise AdapterMismatchError(
            f"{file}: model_type={config.model_type!r} fuses q/k/v (and gate/up) into one projection; torchtune's adapter "
            f"for it adapts them apart, which does not map onto the fused layers"
        )
    if config.model_type not in INTERLEAVED_ROPE:
        raise AdapterMismatchError(f"{file}: model_type={config.model_type!r} has no torchtune 0.6.1 LoRA builder; accepted: {sorted(INTERLEAVED_ROPE)}")
    return config


def _check_rope_rows(weights: dict[str, torch.Tensor], rows: dict[str, int], file: Path) -> None:
    """The q/k lora_B rows must split into the model's heads before they are permuted (a reshape would fail)."""
    for key, tensor in weights.items():
        for proj, expected in rows.items():
            if key.endswith(f"attn.{proj}.lora_b.weight") and (tensor.dim() != 2 or tensor.shape[0] != expected):
                raise AdapterMismatchError(f"{file}: {key} is {list(tensor.shape)}; the model's {proj} needs [{expected}, rank]; was this adapter made for this model?")
