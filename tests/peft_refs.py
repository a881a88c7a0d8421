"""PEFT adapters made in a test, the `PeftModel` reference holding them, and the swapped model they are loaded
into: shared by the adapter tests."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from hf_models import hf_greedy
from peft import LoraConfig, PeftModel, get_peft_model

import etblocks

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


def make_adapters(base: torch.nn.Module, root: Path) -> dict[str, Path]:
    """Every adapter of `ADAPTERS` made for `base` in `root/<name>` (seeded by its order)."""
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        make_adapter(base, root / name, seed, **options)
    return {name: root / name for name in ADAPTERS}


@contextmanager
def peft_with(reference: PeftModel, name: str | None) -> Iterator[PeftModel]:
    """`reference` running adapter `name`, or the base model for None."""
    if name is None:
        with reference.disable_adapter():
            yield reference
    else:
        reference.set_adapter(name)
        yield reference


def switch_and_match_peft(runner, reference: PeftModel, name: str | None, prompt: torch.Tensor, atol: float,
                          new_tokens: int = 32) -> list[int]:
    """`runner.set_adapter(name)`, then the program's last-token logits are PeftModel's with that adapter within
    `atol` and its `new_tokens` greedy tokens equal PeftModel's `generate`; returns those tokens."""
    runner.set_adapter(name)
    with peft_with(reference, name) as model, torch.no_grad():
        expected_logits = model(prompt).logits[0, -1]
        expected = hf_greedy(model, prompt, new_tokens)
    logits = runner.forward(prompt[0].tolist())
    assert (logits - expected_logits).abs().max().item() <= atol, name
    runner.reset()
    tokens = runner.generate(prompt[0].tolist(), max_new_tokens=new_tokens)
    assert tokens == expected, name
    return tokens


def swapped_with(base: torch.nn.Module, dirs: dict[str, Path], backend: str = "xnnpack", max_seq_len: int = 64, **swap_options):
    """A copy of `base` swapped for `backend` with every adapter of `dirs` loaded under its name."""
    model = etblocks.swap(copy.deepcopy(base), backend=backend, max_seq_len=max_seq_len, **swap_options)
    for name, directory in dirs.items():
        etblocks.load_adapter(model, directory, name=name)
    return model


def first_layer_groups(table) -> list[tuple[str, ...]]:
    """The projections of layer 0 whose slots share one `slot_a` (a group of one: its own), by last name."""
    groups: dict[int, set[str]] = {}
    for index, slot in enumerate(table.slots):
        if ".layers.0." in slot.target:
            groups.setdefault(index if slot.group is None else slot.group, set()).add(slot.target.rsplit(".", 1)[1])
    return sorted(tuple(sorted(names)) for names in groups.values())


# q/k/v read the attention norm's output, gate/up the MLP norm's: one x @ A^T each.
SHARED_INPUT_GROUPS = [("down_proj",), ("gate_proj", "up_proj"), ("k_proj", "q_proj", "v_proj"), ("o_proj",)]
