"""PEFT adapters made in a test, and the `PeftModel` reference holding them: shared by the adapter tests."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, PeftModel, get_peft_model

# A: rank and alpha patterns on a subset of modules. B: rsLoRA on every linear layer.
ADAPTERS = {
    "A": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
        rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 32},
    ),
    "B": dict(r=8, lora_alpha=4, use_rslora=True, target_modules="all-linear"),
}


def make_adapter(base: torch.nn.Module, directory, seed: int, **options) -> None:
    """Train nothing: random A and B (`init_lora_weights=False`) so the adapter changes the outputs."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False, **options))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    peft_model.save_pretrained(directory)


def peft_reference(base, dirs) -> PeftModel:
    model = PeftModel.from_pretrained(copy.deepcopy(base), dirs["A"], adapter_name="A")
    model.load_adapter(dirs["B"], adapter_name="B")
    return model.eval()
