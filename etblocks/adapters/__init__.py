"""LoRA adapters kept apart from the base weights: the block, and loaders for adapters people already have."""

from etblocks.adapters.load import adapter_names, attach_adapter, load_adapter, merge_adapter, read_adapter, set_adapter
from etblocks.adapters.lora import LoRALinear, LoRATensors, LoRAWeights

__all__ = ["LoRALinear", "LoRATensors", "LoRAWeights", "adapter_names", "attach_adapter", "load_adapter", "merge_adapter", "read_adapter", "set_adapter"]
