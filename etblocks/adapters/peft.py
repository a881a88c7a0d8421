"""PEFT LoRA adapter directories (`adapter_config.json` + `adapter_model.safetensors` or `.bin`) onto a model.

The saved keys say which modules an adapter touches (`base_model.model.<module>.lora_A.weight`); the config
gives each module's rank and alpha (`r`/`lora_alpha`, overridden per module by `rank_pattern`/`alpha_pattern`,
matched on the module path's suffix as PEFT does) and whether rsLoRA scales by `alpha / sqrt(r)`. Everything is
checked before the model changes: an adapter that does not fit raises `AdapterMismatchError` and leaves it as
it was.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from torch import nn

from etblocks.adapters.lora import LoRALinear, LoRAWeights
from etblocks.errors import AdapterMismatchError, ConfigError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B)\.weight$")


def load_adapter(model: nn.Module, path: str | Path, name: str = "default", scale: float = 1.0) -> list[str]:
    """Attach the PEFT LoRA adapter at `path` to `model` as `name` and make it the active one.

    `scale` multiplies the adapter's own scaling. Target `nn.Linear` modules become `LoRALinear` (a module
    already wrapped gains one more adapter). Returns the adapted module names. Refused with
    `AdapterMismatchError`, nothing changed: DoRA, `modules_to_save`, trained biases, target parameters (MoE
    experts), a target the model lacks, shapes or ranks that do not fit, a corrupt weight file.
    """
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"path={str(path)!r} is not a directory; give a PEFT adapter directory (with {CONFIG_FILE})")
    config = _read_config(path)
    tensors = _read_weights(path)
    layers = _layer_weights(model, config, tensors, path, scale)
    for module_name, weights in layers.items():
        module = model.get_submodule(module_name)
        if isinstance(module, LoRALinear) and name in module.adapters:
            raise AdapterMismatchError(f"{module_name} already has an adapter named {name!r}; give another name=")
    for module_name, weights in layers.items():
        module = model.get_submodule(module_name)
        if not isinstance(module, LoRALinear):
            module = LoRALinear(module)
            parent, _, attr = module_name.rpartition(".")
            setattr(model.get_submodule(parent), attr, module)
        module.add_adapter(name, weights)
    set_adapter(model, name)
    return sorted(layers)


def set_adapter(model: nn.Module, name: str | None) -> None:
    """Make adapter `name` active on every `LoRALinear` that has it (the others run their base alone);
    `None` runs the base model."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    if name is not None and not any(name in m.adapters for m in layers):
        known = sorted({n for m in layers for n in m.adapters})
        raise ConfigError(f"name={name!r} is not a loaded adapter; loaded: {known}, or None for the base model")
    for layer in layers:
        layer.set_adapter(name if name in layer.adapters else None)


def _read_config(path: Path) -> dict:
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


def _layer_weights(model: nn.Module, config: dict, tensors: dict, path: Path, scale: float) -> dict[str, LoRAWeights]:
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key[len(PREFIX):] if key.startswith(PREFIX) else key)
        if match is None:
            raise AdapterMismatchError(f"{path}: unexpected tensor {key!r}; a LoRA adapter holds only lora_A/lora_B weights")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    if not parts:
        raise AdapterMismatchError(f"{path}: the weight file holds no lora_A/lora_B tensors")
    modules = dict(model.named_modules())
    layers = {}
    for module_name, pair in sorted(parts.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterMismatchError(f"{path}: {module_name} has only {sorted(pair)}; need lora_A and lora_B")
        module = modules.get(module_name)
        base = module.base if isinstance(module, LoRALinear) else module
        if not isinstance(base, nn.Linear):
            what = "is not in the model" if module is None else f"is a {type(module).__name__}, not a Linear"
            raise AdapterMismatchError(f"{path}: target module {module_name} {what}; was this adapter made for this model?")
        rank = _pattern_value(config.get("rank_pattern") or {}, module_name, config["r"])
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module_name, config["lora_alpha"])
        lora_A, lora_B = pair["lora_A"], pair["lora_B"]
        expected = (rank, base.in_features), (base.out_features, rank)
        if (tuple(lora_A.shape), tuple(lora_B.shape)) != expected:
            raise AdapterMismatchError(
                f"{path}: {module_name} has lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}; the model's "
                f"{base.in_features} -> {base.out_features} Linear at rank {rank} needs {expected[0]} and {expected[1]}"
            )
        factor = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        dtype = base.weight.dtype
        layers[module_name] = LoRAWeights(lora_A.to(dtype), lora_B.to(dtype), factor * scale)
    return layers
