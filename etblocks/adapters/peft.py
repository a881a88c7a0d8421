"""Reading PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors` or `.bin`).

The saved keys say which modules an adapter touches (`base_model.model.<module>.lora_A.weight`); the config
gives each module's rank and alpha (`r`/`lora_alpha`, overridden per module by `rank_pattern`/`alpha_pattern`,
matched on the module path's suffix as PEFT does) and whether rsLoRA scales by `alpha / sqrt(r)`. Reading needs
no model; `etblocks.adapters.load` checks the result against one.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from etblocks.adapters.lora import LoRATensors
from etblocks.errors import AdapterMismatchError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")


def is_peft_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and any((path / name).is_file() for name in WEIGHT_FILES)


def read_peft_adapter(path: str | Path) -> dict[str, LoRATensors]:
    """`{module name: LoRATensors}` of the PEFT LoRA adapter directory `path`, module names as in the model
    PEFT wrapped (`model.layers.0.self_attn.q_proj`). Refused with `AdapterMismatchError`: DoRA,
    `modules_to_save`, trained biases, target parameters (MoE experts), layer-restricted adapters, ranks that
    disagree with the config, a corrupt or foreign file."""
    path = Path(path)
    config = read_config(path)
    return layer_tensors(config, _read_weights(path), path)


def read_config(path: Path) -> dict:
    """The directory's `adapter_config.json`, with the options etblocks cannot honour refused."""
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise AdapterMismatchError(f"{path} has no {CONFIG_FILE}; not a PEFT adapter directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterMismatchError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterMismatchError(f"{file}: peft_type={config.get('peft_type') if isinstance(config, dict) else None!r}; only LORA adapters are accepted")
    refusals = {
        "use_dora": (bool(config.get("use_dora")), "DoRA rescales the merged weight per column; only plain LoRA is supported"),
        "modules_to_save": (bool(config.get("modules_to_save")), "whole trained copies of modules are not adapters etblocks can keep apart"),
        "bias": (config.get("bias", "none") != "none", "trained base biases are not supported; accepted: 'none'"),
        "target_parameters": (bool(config.get("target_parameters")), "adapters on parameters (MoE experts) are not supported"),
        "layers_to_transform": (config.get("layers_to_transform") is not None, "layer-restricted adapters are not supported yet"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise AdapterMismatchError(f"{file}: {key}={config[key]!r}: {why}")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), (int, float)):
            raise AdapterMismatchError(f"{file}: {key}={config.get(key)!r}; a LoRA config needs a number there")
    return config


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    for file_name in WEIGHT_FILES:
        file = path / file_name
        if not file.is_file():
            continue
        try:
            if file.suffix == ".safetensors":
                from safetensors.torch import load_file

                return load_file(str(file))
            return torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: every reader raises its own type
            raise AdapterMismatchError(f"{file} could not be read as adapter weights: {exc}") from None
    raise AdapterMismatchError(f"{path} has none of {list(WEIGHT_FILES)}")


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rule: the first pattern that matches the end of the module path (after a dot) wins."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def layer_tensors(config: dict, tensors: dict, path: Path) -> dict[str, LoRATensors]:
    """Tensors in PEFT's keys (`[base_model.model.]<module>.lora_A.weight`) per module, with the rank and scaling
    the config (and its patterns) gives that module; shared with the torchtune reader, which converts to these
    keys first."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key[len(PREFIX):] if key.startswith(PREFIX) else key)
        if match is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
            raise AdapterMismatchError(f"{path}: unexpected tensor {key!r}; a LoRA adapter holds only 2-D lora_A/lora_B weights")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterMismatchError(f"{path}: the weight file holds no lora_A/lora_B tensors")
    layers = {}
    for module_name, pair in sorted(parts.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterMismatchError(f"{path}: {module_name} has only {sorted(pair)}; need lora_A and lora_B")
        rank = _pattern_value(config.get("rank_pattern") or {}, module_name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name, config["lora_alpha"])
        lora_A, lora_B = pair["lora_A"], pair["lora_B"]
        if lora_A.shape[0] != rank or lora_B.shape[1] != rank:
            raise AdapterMismatchError(
                f"{path}: {module_name} has lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}; its config "
                f"says rank {rank}, which needs lora_A [{rank}, in] and lora_B [out, {rank}]"
            )
        layers[module_name] = LoRATensors(lora_A, lora_B, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank))
    return layers
