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
    `LoRALinear` (a module already wrapped gains one more adapter). A target that a block split into parts
    (its `projection_parts`, e.g. single-head attention's per-head q/k/v views) gets one `LoRALinear` per part,
    each with the rows of `lora_B` that part computes. Returns the adapted module names as the adapter names
    them. Refused with `AdapterMismatchError`, nothing changed: a target the model lacks, shapes that do not
    fit, a name already taken, anything `read_adapter` refuses.
    """
    path = Path(path)
    return attach_adapter(model, read_adapter(model, path), name, scale, source=str(path))


def attach_adapter(
    model: nn.Module, adapter: dict[str, LoRATensors], name: str, scale: float = 1.0, source: str = "adapter"
) -> list[str]:
    """Attach `adapter` (`{target module name: LoRATensors}`, as `read_adapter` returns it) to `model` as `name`
    and make it the active one; `load_adapter` without the reading. `source` names the adapter in errors."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name={name!r} is not accepted; give a non-empty adapter name")
    layers = {target: _fit(model, target, tensors, source, scale) for target, tensors in adapter.items()}
    for target, parts in layers.items():
        for module_name, _, _ in parts:
            module = model.get_submodule(module_name)
            if isinstance(module, LoRALinear) and name in module.adapters:
                raise AdapterMismatchError(f"{target} already has an adapter named {name!r}; give another name=")
    for target, parts in layers.items():
        for module_name, rows, weights in parts:
            _wrapped(model, module_name, target, rows).add_adapter(name, weights)
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


def merge_adapter(model: nn.Module, name: str) -> list[str]:
    """Fold adapter `name` into the base weights and drop every `LoRALinear` (PEFT's `merge_and_unload`): the
    model is then a plain model with that adapter baked in, which exports without LoRA slots and decodes at the
    base model's speed; the other adapters are discarded. Returns the merged module names."""
    set_adapter(model, name)
    merged = []
    for module_name, layer in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        if layer.active is not None:
            layer.merge()
            merged.append(module_name)
        parent, _, attr = module_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer.base)
    return merged


def adapter_names(model: nn.Module) -> list[str]:
    """The names of the adapters loaded into `model`."""
    return sorted({n for m in model.modules() if isinstance(m, LoRALinear) for n in m.adapters})


def _fit(
    model: nn.Module, target: str, tensors: LoRATensors, source: str, scale: float
) -> list[tuple[str, tuple[int, int] | None, LoRAWeights]]:
    """`tensors` checked against the modules that now compute `target`, as `(module name, rows, weights)` per
    module with `lora_B` cut to its rows."""
    parts = _parts_computing(model, target)
    modules = [model.get_submodule(module_name) for module_name, _ in parts]
    bases = [module.base if isinstance(module, LoRALinear) else module for module in modules]
    odd = next((module for module, base in zip(modules, bases) if not isinstance(base, (nn.Linear, Conv2dLinear))), None)
    if not parts or odd is not None:
        what = "is not in the model" if not parts else f"is a {type(odd).__name__}, not a Linear"
        raise AdapterMismatchError(f"{source}: target module {target} {what}; was this adapter made for this model?")
    lora_A, lora_B, factor = tensors
    rank = lora_A.shape[0]
    in_features = bases[0].in_features
    out_features = bases[0].out_features if parts[0][1] is None else max(stop for _, (_, stop) in parts)
    expected = (rank, in_features), (out_features, rank)
    if (tuple(lora_A.shape), tuple(lora_B.shape)) != expected:
        raise AdapterMismatchError(
            f"{source}: {target} has lora_A {tuple(lora_A.shape)}, lora_B {tuple(lora_B.shape)}; the model's "
            f"{in_features} -> {out_features} layer at rank {rank} needs {expected[0]} and {expected[1]}"
        )
    dtype = bases[0].weight.dtype
    lora_A, lora_B = lora_A.to(dtype), lora_B.to(dtype)
    return [
        (module_name, rows, LoRAWeights(lora_A, lora_B if rows is None else lora_B[slice(*rows)], factor * scale))
        for module_name, rows in parts
    ]


def _parts_computing(model: nn.Module, target: str) -> list[tuple[str, tuple[int, int] | None]]:
    """`(module name, rows)` of what computes `target`'s output now: the module itself (rows None: all), or the
    parts its parent block split it into (`projection_parts`); empty if neither exists."""
    try:
        model.get_submodule(target)
        return [(target, None)]
    except AttributeError:
        pass
    parent_name, _, child = target.rpartition(".")
    try:
        parent = model.get_submodule(parent_name)
    except AttributeError:
        return []
    prefix = f"{parent_name}." if parent_name else ""
    return [(prefix + module, rows) for module, rows in getattr(parent, "projection_parts", {}).get(child, [])]


def _wrapped(model: nn.Module, module_name: str, target: str, rows: tuple[int, int] | None) -> LoRALinear:
    """The `LoRALinear` at `module_name`, wrapping the module there on first use."""
    module = model.get_submodule(module_name)
    if isinstance(module, LoRALinear):
        return module
    module = LoRALinear(module, target=target, rows=rows)
    parent, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)
    return module
