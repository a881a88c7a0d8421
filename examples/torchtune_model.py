"""A torchtune LoRA model to one ExecuTorch program plus its adapter file, generating like torchtune.

    python examples/torchtune_model.py [out_dir]

A tiny random-weight `lora_llama3_2` from torchtune's component builder stands in for your fine-tuned model
(`llama3_2_1b` / `lora_llama3_2_1b` with the checkpoint loaded by torchtune). `swap` replaces torchtune's
attention in place and turns its `LoRALinear` layers into the base weights plus the etblocks adapter "default";
`export` writes `model.pte` (the base) and `model.default.ptd` (the adapter), and the runner switches it on and
off without reloading.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import etblocks
from etblocks.torchtune_compat import import_torchtune

import_torchtune()  # torchtune 0.6.1 on torchao 0.18 needs the NF4 alias etblocks installs
from torchtune.models.llama3_2._component_builders import lora_llama3_2  # noqa: E402

PROMPT = [1, 17, 42, 99, 7]


def lora_model() -> torch.nn.Module:
    """LoRA (rank 8) on the attention projections and the MLP, with random weights standing in for trained ones."""
    torch.manual_seed(0)
    model = lora_llama3_2(
        ["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True, lora_rank=8, lora_alpha=16,
        vocab_size=256, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128, max_seq_len=256,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, 0.05 if name.startswith("tok_embeddings") else 0.1 if "lora" in name else 0.3)
    return model.eval()


def main(out_dir: Path) -> dict[str | None, list[int]]:
    """Greedy tokens with the adapter and without it, from one loaded program."""
    model = etblocks.swap(lora_model(), backend="xnnpack", max_seq_len=128)
    result = etblocks.export(model, backend="xnnpack", out=out_dir / "model.pte")
    runner = etblocks.Runner(result.path, adapters=result.adapters)
    tokens = {}
    for adapter in ("default", None):
        runner.set_adapter(adapter)
        tokens[adapter] = runner.generate(PROMPT, max_new_tokens=12)
        print(f"adapter {adapter!r}: {tokens[adapter]}")
    return tokens


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp))
