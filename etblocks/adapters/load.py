"""Attaching LoRA adapters to a model: `load_adapter` reads an adapter directory (PEFT, or a torchtune
checkpoint), checks every target against the model, then wraps the targets in `LoRALinear`.

Everything is checked before the model changes: an adapter that does not fit raises `AdapterMismatchError` and
leaves it as it was.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from etblocks.adapters.lora import LoRALinear, LoRATensors, LoRAWeights
from etblocks.adapters.peft import CONFIG_FILE, WEIGHT_FILES, is_peft_dir, read_peft_adapter
from etblocks.adapters.torchtune import WEIGHT_FILE as TORCHTUNE_WEIGHT_FILE
from etblocks.adapters.torchtune import is_torchtune_dir, read_torchtune_adapter
from etblocks.attention.conv import Conv2dLinear
from etblocks.errors import AdapterMismatchError, ConfigError


def read_adapter(model: nn.Module, path: str | Path) -> dict[str, LoRATensors]:
    """The adapter at `path` as `{upstream module name: LoRATensors}`, whatever format it was saved in.

    torchtune's own `adapter_model.pt` wins over the PEFT copy its HF checkpointer writes next to it: that copy
    has qwen2's q/k rows permuted for a rope qwen2 does not use (see `etblocks.adapters.torchtune`).
    """
    path = Path(path)
    expected = f"a PEFT adapter directory ({CONFIG_FILE} + one of {list(WEIGHT_FILES)}) or a torchtune checkpoint directory ({TORCHTUNE_WEIGHT_FILE} + {CONFIG_FILE})"
    if not path.is_dir():
        raise ConfigError(f"path={str(path)!r} is not a directory; give {expected}")
    if is_torchtune_dir(path):
        return read_torchtune_adapter(model, path)
    if is_peft_dir(path):
        return read_peft_adapter(path)
    found = sorted(p.name for p in path.iterdir())
    raise AdapterMismatchError(f"{path} holds {found}; expected {expected}")


def load_adapter(model: nn.Module, path: str | Path, name: str = "default", scale: float = 1.0) -> list[str]:
    """Attach the LoRA adapter at `path` to `model` as `name` and make it the active one.

    `scale` multiplies the adapter's own scaling. Target `nn.Linear` (or `Conv2dLinear`) modules become
    `LoRALinear` (a module already wrapped gains one more adapter). Returns the adapted module names. Refused
    with `AdapterMismatchError`, nothing changed: a target the model lacks, shapes that do not fit, a name
    already taken, anything `read_adapter` refuses.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name={name!r} is not accepted; give a non-empty adapter name")
    path = Path(path)
    layers = {module_name: _fit(model, module_name, tensors, path, scale) for module_name, tensors in read_adapter(model, path).items()}
    for module_name in layers:
        module = model.get_submodule(module_name)
        if isinstance(module, LoRALinear) and name in module.adapters:
            raise AdapterMismatchError(f"{module_name} already has an adapter named {name!r}; give another name=")
    for module_name, weights in layers.items():
        module = model.get_submodule(module_name)
        if not isinstance(module, LoRALinear):
            module = LoRALinear(module, target=module_name)
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
        raise ConfigError(f"name={name!r} is not a loaded adapter; loaded: {adapter_names(model)}, or None for the base model")
    for layer in layers:
        layer.set_adapter(name if name in layer.adapters else None)


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the adapters loaded into `model`."""
    return sorted({n for m in model.modules() if isinstance(m, LoRALinear) for n in m.adapters})


def _fit(model: nn.Module, module_name: str, tensors: LoRATensors, path: Path, scale: float) -> LoRAWeights:
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        module = None
    base = module.base if isinstance(module, LoRALinear) else module
    if not isinstance(base, (nn.Linear, Conv2dLinear)):
        what = "is not in the model" if module is None else f"is a {type(module).__name__}, not a Linear"
        raise AdapterMismatchError(f"{path}: target module {module_name} {what}; was this adapter made for this model?")
    lora_A, lora_B, factor = tensors
    rank = lora_A.shape[0]
    expected = (rank, base.in_features), (base.out_features, rank)
    if (tuple(lora_A.shape), tuple(lora_B.shape)) != expected:
        raise AdapterMismatchError(
            f"{path}: {module_name} has lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}; the model's "
            f"{base.in_features} -> {base.out_features} layer at rank {rank} needs {expected[0]} and {expected[1]}"
        )
    dtype = base.weight.dtype
    return LoRAWeights(lora_A.to(dtype), lora_B.to(dtype), factor * scale)
