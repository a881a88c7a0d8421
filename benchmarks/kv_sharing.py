"""Cache bytes of KV-shared text decoders: one cache per source layer against a cache per layer.

Gemma-3n-E2B- and Gemma-4-E2B-shaped text decoders (the shapes below; a 256-token vocabulary, which no cache
depends on) are built on the meta device, so no weights are allocated, and swapped without the probe (meta
tensors hold no values; the probe's numerics are the tests' business: tests/export/test_kv_shared_programs.py).
Each is swapped twice more with the same shape but `num_kv_shared_layers=0` (every layer its own cache, what a
program without KV sharing holds). The figures are the bytes of the state each program declares: the static
contract's input tensors (openvino recipe) and the dynamic program's mutable buffers (xnnpack recipe), fp32.

The check: the static contract holds exactly one K/V pair per source layer (and, without sharing, one per layer).

    python benchmarks/kv_sharing.py                 # context 2048 -> benchmarks/results/kv_sharing.json
    python benchmarks/kv_sharing.py --context 8192
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Checks, add_run_args, aligned_table, finish, parse_with_smoke  # noqa: E402

import etblocks  # noqa: E402
from etblocks.export.programs import static_program  # noqa: E402
from etblocks.state import find_states  # noqa: E402

SMOKE = {"context": 256}
SLIDING_PATTERN = ["sliding_attention"] * 4 + ["full_attention"]
# Gemma 3n E2B's text decoder (30 layers, the last 10 reuse keys and values) and Gemma 4 E2B's (35 layers, the
# last 20 reuse; full layers with 512-wide heads), as ExecuTorch 1.5.1's gemma4 example configures it.
SHAPES = {
    "gemma3n_text (E2B)": ("gemma3n_text", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=30, num_kv_shared_layers=10, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, sliding_window=512, layer_types=SLIDING_PATTERN * 6,
        hidden_size_per_layer_input=256, activation_sparsity_pattern=[0.0] * 30,
    )),
    "gemma4_text (E2B)": ("gemma4_text", dict(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_kv_shared_layers=20, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512, layer_types=SLIDING_PATTERN * 7,
        hidden_size_per_layer_input=256,
    )),
}
SMALL_VOCAB = dict(vocab_size=256, vocab_size_per_layer_input=256)


def meta_model(model_type: str, shape: dict, shared: bool) -> torch.nn.Module:
    overrides = {**shape, **SMALL_VOCAB, **({} if shared else {"num_kv_shared_layers": 0})}
    config = transformers.AutoConfig.for_model(model_type, **overrides)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def state_bytes(model_type: str, shape: dict, shared: bool, backend: str, context: int) -> tuple[int, int]:
    """`(number of cache tensors, their bytes)` a program for `backend` declares."""
    model = meta_model(model_type, shape, shared)
    with torch.device("meta"):
        etblocks.swap(model, backend=backend, max_seq_len=context, verify=False, **({"chunk": 64} if backend == "openvino" else {}))
    if backend == "openvino":
        contract = static_program(model).contract
        sizes = [torch.Size(s).numel() * torch.finfo(torch.float32).bits // 8 for s in contract.state_shapes()]
        return len(sizes), sum(sizes)
    buffers = [getattr(state, spec.name) for state in find_states(model) for spec in state.specs()]
    return len(buffers), sum(b.numel() * b.element_size() for b in buffers)


def main(argv: Sequence[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048)
    add_run_args(parser, "kv_sharing", SMOKE)
    args = parse_with_smoke(parser, argv, SMOKE)
    checks, lines, figures = Checks(), [], {}
    for name, (model_type, shape) in SHAPES.items():
        layers = shape["num_hidden_layers"]
        sources = layers - shape["num_kv_shared_layers"]
        for backend, program in (("openvino", "static inputs"), ("xnnpack", "dynamic buffers")):
            n_shared, shared = state_bytes(model_type, shape, True, backend, args.context)
            n_own, own = state_bytes(model_type, shape, False, backend, args.context)
            for label, count, expected in (("shared", n_shared, 2 * sources), ("per layer", n_own, 2 * layers)):
                if count != expected:
                    checks.fail(f"{name} {program} ({label}): {count} cache tensors, expected {expected}")
            figures[f"{name}, {program}"] = {"shared_bytes": shared, "per_layer_bytes": own, "tensors": [n_shared, n_own]}
            lines.append([name, program, f"{n_shared // 2} of {layers}", f"{shared / 2**20:.1f}", f"{own / 2**20:.1f}",
                          f"{own / shared:.2f}x"])
    table = aligned_table(["text decoder", "program", "layers with a cache", "shared MiB", "cache per layer MiB", "saved"], lines)
    title = f"fp32 K/V cache bytes at context {args.context} (sliding layers keep a 512-row ring)"
    print(title + "\n" + table)
    return finish("kv_sharing", args, checks, {title: table}, started, figures=figures)


if __name__ == "__main__":
    sys.exit(main())
