"""LoRA adapters kept apart from the base weights: the block, and loaders for adapters people already have."""

from etblocks.adapters.lora import LoRALinear, LoRAWeights
from etblocks.adapters.peft import load_adapter, set_adapter

__all__ = ["LoRALinear", "LoRAWeights", "load_adapter", "set_adapter"]
