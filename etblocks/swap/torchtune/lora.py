"""torchtune's `LoRALinear` as a base `nn.Linear` plus an etblocks adapter."""

from __future__ import annotations

from torch import nn

from etblocks.adapters.lora import LoRATensors


def is_lora_linear(module: nn.Module) -> bool:
    """A torchtune `LoRALinear` (or a subclass), recognised without importing torchtune."""
    return any(cls.__name__ == "LoRALinear" and cls.__module__ == "torchtune.modules.peft.lora" for cls in type(module).__mro__)


def base_linear(module: nn.Module) -> nn.Module:
    """The base layer of a torchtune `LoRALinear` as an `nn.Linear` over the same parameters (moved, not
    copied); any other module as it is."""
    if not is_lora_linear(module):
        return module
    linear = nn.Linear(module.in_dim, module.out_dim, bias=module.bias is not None, device="meta")
    linear.weight = module.weight
    linear.bias = module.bias
    return linear


def lora_tensors(name: str, module: nn.Module) -> LoRATensors:
    """The LoRA half of a torchtune `LoRALinear` (scaling `alpha / rank`); `ValueError` for the variants whose
    output is not `W x + scale B A x` (QAT fake quantization, an NF4 base)."""
    if type(module).__name__ != "LoRALinear":
        raise ValueError(f"{name} is a {type(module).__name__}; accepted: torchtune's plain LoRALinear (QAT LoRA is not supported)")
    if module._quantize_base:
        raise ValueError(f"{name} has an NF4-quantized base (quantize_base=True); accepted: a full-precision base")
    return LoRATensors(module.lora_a.weight.detach(), module.lora_b.weight.detach(), module.alpha / module.rank)
