"""One base model, two LoRA adapters made with PEFT, shipped as small separate files and switched at run time.

    python examples/lora_adapters.py [out_dir]

A tiny random-weight Llama stands in for your checkpoint (`AutoModelForCausalLM.from_pretrained(path)`), and
the adapters are made here with PEFT instead of trained; any PEFT adapter directory or torchtune LoRA checkpoint
loads the same way. The export writes `model.pte` (the base, with LoRA slots and a `set_adapter` method) and one
`model.<name>.ptd` per adapter; the runner loads the base once and switches in about a millisecond.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import etblocks

ADAPTERS = {
    "chat": LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
    "code": LoraConfig(r=4, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
}


def base_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def make_adapter(base: torch.nn.Module, config: LoraConfig, directory: Path, seed: int) -> Path:
    """A PEFT adapter directory with random (untrained) LoRA weights, so that it changes the outputs."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.2)
    peft_model.save_pretrained(directory)
    peft_model.unload()  # take PEFT's layers out of `base` again
    return directory


def export_with_adapters(base: torch.nn.Module, adapter_dirs: dict[str, Path], out: Path) -> etblocks.ExportResult:
    """Swap for XNNPACK, attach every adapter, export: the base program plus one .ptd per adapter."""
    etblocks.swap(base, backend="xnnpack", max_seq_len=128)
    for name, directory in adapter_dirs.items():
        etblocks.load_adapter(base, directory, name=name)
    return etblocks.export(base, backend="xnnpack", out=out / "model.pte")


def main(out_dir: Path) -> dict[str | None, list[int]]:
    """Greedy tokens with each adapter and with none, all from one loaded program."""
    base = base_model()
    adapter_dirs = {name: make_adapter(base, config, out_dir / name, seed) for seed, (name, config) in enumerate(ADAPTERS.items())}
    result = export_with_adapters(base, adapter_dirs, out_dir)
    print(f"base program {result.path} ({result.size_mb:.2f} MB)")
    for name, file in result.adapters.items():
        print(f"adapter {name!r}: {file} ({file.stat().st_size / 1e3:.1f} KB)")
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    prompt = [1, 17, 42, 99, 7]
    tokens = {}
    for name in (*ADAPTERS, None):
        runner.set_adapter(name)
        tokens[name] = runner.generate(prompt, max_new_tokens=12)
        print(f"{name or 'base'}: {tokens[name]}")
    return tokens


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="etblocks-lora-")))
